"""A run's LoRA adapters as a ``peft`` folder: ``adapter_config.json`` + ``adapter_model.safetensors`` with ``peft``'s
key names (``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``), so that
``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), FOLDER)`` runs the model the swarm trained.
``read_peft_folder`` reads such a folder back (a client generating with exported adapters)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from peers.core.folders import folder_replacing, write_json
from peers.model.config import ModelConfig

from .lora import LoraSpec, parse_adapter, site_key, split_key

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
EXPORT_INFO = "export.json"
_LAYERS = {"llama": "model.layers.", "gpt2": "transformer.h."}  # the module path of block i in transformers
_KEY = re.compile(r"base_model\.model\.(?:model\.layers|transformer\.h)\.(\d+)\.([a-z0-9_.]+)\.lora_([AB])\.weight")


def peft_key(family: str, key: str, which: str) -> str:
    """The ``peft`` name of ``lora_A`` / ``lora_B`` (``which``) of our parameter key (``3-self_attn-q_proj``)."""
    layer, path = split_key(key)
    return f"base_model.model.{_LAYERS[family]}{layer}.{path}.lora_{which}.weight"


def peft_tensors(family: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``LoraAdapter.state_dict()``s (merged over the stages) under ``peft``'s names, float32, contiguous."""
    out = {}
    for name, tensor in state.items():
        which, _, key = name.partition(".")  # lora_A.3-self_attn-q_proj
        out[peft_key(family, key, which[-1])] = tensor.detach().to("cpu", torch.float32).contiguous().clone()
    return out


def adapter_config(spec: LoraSpec, family: str, base_model: str) -> dict[str, Any]:
    """``peft``'s ``LoraConfig`` as JSON for ``spec`` (no dropout, no bias; GPT-2's Conv1D is fan-in-fan-out)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": spec.rank, "lora_alpha": spec.alpha, "target_modules": list(spec.targets), "lora_dropout": 0.0,
            "bias": "none", "fan_in_fan_out": family == "gpt2", "inference_mode": True, "init_lora_weights": True,
            "use_rslora": False, "use_dora": False, "modules_to_save": None}


def save_peft_folder(out_dir: str | Path, spec: LoraSpec, model_dir: str | Path, state: dict[str, torch.Tensor], *,
                     info: dict[str, Any] | None = None, overwrite: bool = False) -> Path:
    """Write ``out_dir`` (atomically): the adapter config, the tensors under ``peft``'s names, and ``export.json``."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise ValueError(f"{out_dir} exists and is not empty: choose another --out or pass --force")
    family = ModelConfig.from_dir(model_dir).family
    with folder_replacing(out_dir) as tmp:
        write_json(tmp / CONFIG_FILE, adapter_config(spec, family, str(Path(model_dir).resolve())))
        save_file(peft_tensors(family, state), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        if info is not None:
            write_json(tmp / EXPORT_INFO, info, indent=1)
    return out_dir


def read_peft_folder(folder: str | Path) -> tuple[LoraSpec, dict[str, torch.Tensor]]:
    """A ``peft`` LoRA folder as our spec and ``LoraAdapter`` state (``lora_A.3-self_attn-q_proj``: tensor).
    ``ValueError`` for what we cannot run exactly (dropout aside: it is off at inference): other adapter types,
    biases, rsLoRA/DoRA, extra trained modules, or keys that are not a block's projection."""
    folder = Path(folder)
    if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise ValueError(f"{folder} is not a peft adapter folder: it needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    config = json.loads((folder / CONFIG_FILE).read_text())
    unsupported = [k for k in ("use_rslora", "use_dora", "modules_to_save") if config.get(k)]
    if config.get("peft_type") != "LORA" or config.get("bias", "none") != "none" or unsupported:
        raise ValueError(f"{folder}: only plain LoRA adapters (no bias, rsLoRA, DoRA or modules_to_save) can run on "
                         f"the swarm's peers; this one has peft_type={config.get('peft_type')!r}, bias="
                         f"{config.get('bias')!r}{', ' + ', '.join(unsupported) if unsupported else ''}")
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        raise ValueError(f"{folder}: target_modules as a pattern ({targets[:60]!r}) is not supported: list the names")
    spec = parse_adapter(f"lora:r={int(config['r'])},alpha={float(config['lora_alpha'])},targets={'+'.join(targets)}")
    assert spec is not None
    state: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(folder / WEIGHTS_FILE)).items():
        match = _KEY.fullmatch(name)
        if match is None:
            raise ValueError(f"{folder}: tensor {name[:120]!r} is not a LoRA matrix of a block's projection")
        layer, path, which = int(match[1]), match[2], match[3]
        state[f"lora_{which}.{site_key(layer, path)}"] = tensor
    return spec, state
