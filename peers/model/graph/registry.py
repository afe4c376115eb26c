"""The architectures a peer can trace into an operator graph: builders every peer has locally.

A run names an architecture, its config and (optionally) a weights folder; every peer builds and traces the same
graph itself (``trace_architecture``) and compares ``graph_hash`` with the trainer's. Nothing executable travels.

- ``resnet18/34/50/101/152`` (vision, fx): config ``{"num_classes": 1000, "zero_init_residual": false}``;
  inputs ``{"batch": B, "image_size": 224}``; weights ``model.safetensors`` with torchvision's key names.
- ``gpt2``, ``llama`` (causal LM, export): transformers' own code (``GPT2LMHeadModel``; ``LlamaForCausalLM`` and
  the Qwen2/Mistral folders) on a Hugging Face folder, the weights.
- ``gpt2-blocks``, ``llama-blocks`` (causal LM, export): our block code (``peers.model``) on the same folders.
Causal LMs take inputs ``{"batch": B, "seq_len": T}`` and give logits; they are traced in eval mode (dropout off).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from .hashing import graph_hash
from .resnet import DEPTHS, resnet
from .trace import OpGraph, trace

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class Architecture:
    """How to build, load and feed one registered architecture."""

    name: str
    kind: str  # "vision" | "causal_lm"
    tracer: str  # "fx" | "export"
    config_keys: Mapping[str, Any]  # allowed config keys and their defaults (empty: the weights folder's config)
    input_keys: Mapping[str, Any]  # allowed input-shape keys and their defaults
    build: Callable[[dict[str, Any], Path | None], nn.Module]

    def example_inputs(self, inputs: Mapping[str, Any]) -> tuple[torch.Tensor, ...]:
        shape = _with_defaults("inputs", self.name, inputs, self.input_keys)
        if self.kind == "vision":
            b, s = int(shape["batch"]), int(shape["image_size"])
            return (torch.zeros(b, 3, s, s),)
        b, t = int(shape["batch"]), int(shape["seq_len"])
        return (torch.arange(b * t).reshape(b, t) % 256,)


def _with_defaults(what: str, arch: str, given: Mapping[str, Any], allowed: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise ValueError(f"{arch} does not take {what} {unknown}; it takes {sorted(allowed)}")
    return {**allowed, **given}


def _build_resnet(name: str) -> Callable[[dict[str, Any], Path | None], nn.Module]:
    def build(config: dict[str, Any], weights: Path | None) -> nn.Module:
        model = resnet(name, int(config["num_classes"]), bool(config["zero_init_residual"]))
        if weights is not None:
            file = weights / WEIGHTS_FILE
            if not file.is_file():
                raise ValueError(f"no {WEIGHTS_FILE} in {weights}: save the state_dict there with safetensors")
            try:
                missing, unexpected = model.load_state_dict(load_file(str(file)), strict=False)
            except RuntimeError as e:  # a tensor of another shape
                raise ValueError(f"{file} does not fit {name} with {config}: {str(e).splitlines()[-1].strip()}") from e
            if missing or unexpected:
                raise ValueError(f"{file} does not fit {name} with {config}: missing {missing[:5]}, "
                                 f"unexpected {unexpected[:5]}")
        return model
    return build


class _Logits(nn.Module):
    """``input_ids -> logits`` of a transformers causal LM, with no cache (the graph has one output)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def _build_hf(arch: str, model_types: tuple[str, ...]) -> Callable[[dict[str, Any], Path | None], nn.Module]:
    """transformers' own model code for a Hugging Face folder whose ``model_type`` is one of ``model_types``."""
    def build(config: dict[str, Any], weights: Path | None) -> nn.Module:
        try:
            from transformers import AutoConfig, AutoModelForCausalLM
        except ImportError as e:
            raise ValueError(f"architecture {arch!r} traces transformers' code: pip install transformers") from e
        if weights is None:
            raise ValueError(f"{arch} needs a weights folder (a Hugging Face folder; `swarm new-model`)")
        model_type = AutoConfig.from_pretrained(str(weights)).model_type
        if model_type not in model_types:
            raise ValueError(f"{arch} takes a folder of model_type {' or '.join(model_types)}; {weights} holds "
                             f"{model_type!r}")
        return _Logits(AutoModelForCausalLM.from_pretrained(str(weights), dtype=torch.float32))
    return build


class _OurBlocks(nn.Module):
    """Our block code (``peers.model``) as ``input_ids -> logits`` (positions 0..T-1, no cache)."""

    def __init__(self, weights: Path, family: str) -> None:
        super().__init__()
        from ..local import LocalModel

        self.model = LocalModel.from_dir(weights)
        self.family = family
        if self.model.config.family != family:
            raise ValueError(f"{family}-blocks needs a {family} folder, {weights} holds a "
                             f"{self.model.config.family} model")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        emb, t = self.model.embedding, input_ids.shape[1]
        positions = torch.arange(t, device=input_ids.device).expand(input_ids.shape[0], t)
        # GPT-2's embed() checks the positions against its table with a data-dependent branch export cannot trace
        hidden = emb.wte(input_ids) + emb.wpe(positions) if self.family == "gpt2" else emb.embed(input_ids, positions)
        for block in self.model.blocks:
            hidden = block(hidden, positions)[0]
        return self.model.head.head(hidden)


def _build_ours(family: str) -> Callable[[dict[str, Any], Path | None], nn.Module]:
    def build(config: dict[str, Any], weights: Path | None) -> nn.Module:
        if weights is None:
            raise ValueError(f"{family}-blocks needs a weights folder (`swarm new-model --family {family}`)")
        return _OurBlocks(weights, family)
    return build


_VISION_CONFIG = {"num_classes": 1000, "zero_init_residual": False}
_VISION_INPUTS = {"batch": 1, "image_size": 224}
_LM_INPUTS = {"batch": 1, "seq_len": 16}

ARCHITECTURES: dict[str, Architecture] = {
    **{name: Architecture(name, "vision", "fx", _VISION_CONFIG, _VISION_INPUTS, _build_resnet(name))
       for name in DEPTHS},
    "gpt2": Architecture("gpt2", "causal_lm", "export", {}, _LM_INPUTS, _build_hf("gpt2", ("gpt2",))),
    "llama": Architecture("llama", "causal_lm", "export", {}, _LM_INPUTS,
                          _build_hf("llama", ("llama", "qwen2", "mistral"))),
    "gpt2-blocks": Architecture("gpt2-blocks", "causal_lm", "export", {}, _LM_INPUTS, _build_ours("gpt2")),
    "llama-blocks": Architecture("llama-blocks", "causal_lm", "export", {}, _LM_INPUTS, _build_ours("llama")),
}


def get_architecture(name: str) -> Architecture:
    """The registered architecture ``name``; ``ValueError`` listing the known ones otherwise."""
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {name!r}: peers only trace architectures they have locally; "
                         f"known: {', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[name]


def build_model(arch: str, config: Mapping[str, Any] | None = None, weights: str | Path | None = None,
                *, seed: int = 0) -> nn.Module:
    """Build ``arch`` (random init from ``seed`` unless ``weights``, a local folder, is given), in eval mode."""
    spec = get_architecture(arch)
    cfg = _with_defaults("config", arch, dict(config or {}), spec.config_keys)
    folder = None if weights is None else Path(weights)
    if folder is not None and not folder.is_dir():
        raise ValueError(f"weights folder {folder} does not exist")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = spec.build(cfg, folder)
    return model.eval()


def trace_architecture(arch: str, config: Mapping[str, Any] | None = None, inputs: Mapping[str, Any] | None = None,
                       weights: str | Path | None = None, *, seed: int = 0, train: bool = False) -> OpGraph:
    """Build and trace ``arch``; ``train`` sets the mode the model is in (fx graphs may switch it later)."""
    spec = get_architecture(arch)
    if train and spec.tracer == "export":
        raise ValueError(f"{arch} is traced in eval mode (its graph fixes dropout off); trace with train=False")
    model = build_model(arch, config, weights, seed=seed).train(train)
    return trace(model, spec.example_inputs(dict(inputs or {})), tracer=spec.tracer, arch=arch)


def check_graph_hash(graph: OpGraph, expected: str) -> None:
    """``ValueError`` unless this peer's trace of a run's graph has the trainer's hash."""
    mine = graph_hash(graph)
    if mine != expected:
        raise ValueError(f"graph hash mismatch for {graph.arch}: the trainer traced {expected[:16]}, this peer "
                         f"{mine[:16]}; trace the same architecture, config and input shape (and the same torch and "
                         f"transformers versions)")
