"""``ModelConfig``: the subset of a Hugging Face ``config.json`` that our block code needs."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from peers.core.ids import DTYPES

from .hub import cache_name

logger = logging.getLogger(__name__)

FAMILIES: dict[str, str] = {"llama": "llama", "qwen2": "llama", "mistral": "llama", "gpt2": "gpt2"}
ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
ACTIVATIONS = ("silu", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
_DTYPES = {**DTYPES, "fp32": torch.float32, "float": torch.float32, "fp16": torch.float16, "half": torch.float16,
           "bf16": torch.bfloat16}  # config.json spellings


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """Turn ``"float16"``/``"bf16"``/``torch.float32``... into a ``torch.dtype``."""
    if isinstance(name, torch.dtype):
        return name
    key = str(name).removeprefix("torch.").lower()
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[key]


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family or GPT-2 model, parsed from ``config.json``."""

    family: str
    model_type: str
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    norm_eps: float
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # None means plain RoPE; else includes "rope_type"
    attention_bias: bool = False  # bias on q/k/v projections
    o_proj_bias: bool = False  # bias on the attention output projection
    mlp_bias: bool = False
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = field(default=())  # per layer: "full_attention" | "sliding_attention"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read ``<path>/config.json``; the folder's base name becomes ``name`` (``org--name`` for a snapshot of the
        Hugging Face cache, ``peers.model.hub``)."""

        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"no config.json in {path}: is it a Hugging Face model folder?")
        with cfg_file.open() as f:
            raw = json.load(f)
        return cls.from_dict(raw, name=cache_name(path) or path.resolve().name)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], name: str = "") -> ModelConfig:
        """Parse a ``config.json`` dict (transformers 4.x and 5.x layouts)."""
        model_type = raw.get("model_type")
        if model_type not in FAMILIES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(FAMILIES)}")
        parse = _parse_gpt2 if FAMILIES[model_type] == "gpt2" else _parse_llama
        kw = parse(raw)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        cfg = cls(
            family=FAMILIES[model_type], model_type=model_type, name=name,
            vocab_size=int(raw["vocab_size"]),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32").removeprefix("torch."),
            bos_token_id=raw.get("bos_token_id"), eos_token_ids=eos_ids, **kw,
        )
        cfg._validate()
        return cfg

    def _validate(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {self.hidden_act!r}; supported: {ACTIVATIONS}")
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if self.family == "gpt2" and self.num_heads * self.head_dim != self.hidden_size:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}")

    def sliding_window_for(self, layer_idx: int) -> int | None:
        """Sliding attention window of layer ``layer_idx``, or None for full causal attention."""
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else str(self.rope_scaling["rope_type"])

    @property
    def block_param_count(self) -> int:
        """Number of parameters in one transformer block."""
        h, i = self.hidden_size, self.intermediate_size
        if self.family == "gpt2":
            return (h * 3 * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h) + 4 * h
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        attn += (q + 2 * kv) * self.attention_bias + h * self.o_proj_bias
        mlp = 3 * h * i + (2 * i + h) * self.mlp_bias
        return attn + mlp + 2 * h


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from ``rope_parameters`` (tf 5) or ``rope_scaling`` (tf 4)."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope_parameters are not supported")
    theta = float(params.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {ROPE_TYPES}")
    partial = params.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1.0):
        raise ValueError(f"partial_rotary_factor={partial} is not supported")
    if rope_type == "default":
        return theta, None
    if "factor" not in params:
        raise ValueError(f"rope_type {rope_type!r} needs a 'factor' in rope_scaling")
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", raw["max_position_embeddings"])
        for key in ("low_freq_factor", "high_freq_factor"):
            if key not in params:
                raise ValueError(f"rope_type 'llama3' needs {key!r} in rope_scaling")
    return theta, {"rope_type": rope_type, **params}


def _parse_llama(raw: dict[str, Any]) -> dict[str, Any]:
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    layers = int(raw["num_hidden_layers"])
    theta, scaling = _rope(raw)
    model_type = raw["model_type"]
    if model_type == "qwen2":
        qkv_bias, o_bias = True, False
        window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
        first_sliding = int(raw.get("max_window_layers", 28))
        default_types = ["sliding_attention" if window and i >= first_sliding else "full_attention"
                         for i in range(layers)]
        types = tuple(raw.get("layer_types") or default_types)
    else:
        qkv_bias = o_bias = bool(raw.get("attention_bias", False))
        window = raw.get("sliding_window") if model_type == "mistral" else None
        types = tuple("sliding_attention" if window else "full_attention" for _ in range(layers))
    return dict(
        hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        intermediate_size=int(raw["intermediate_size"]),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
        attention_bias=qkv_bias, o_proj_bias=o_bias, mlp_bias=bool(raw.get("mlp_bias", False)),
        hidden_act=str(raw.get("hidden_act", "silu")),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        sliding_window=int(window) if window else None, layer_types=types,
    )


def _parse_gpt2(raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("scale_attn_by_inverse_layer_idx") or not raw.get("scale_attn_weights", True):
        raise ValueError("GPT-2 configs with scale_attn_by_inverse_layer_idx or without "
                         "scale_attn_weights are not supported")
    hidden = int(raw.get("n_embd", raw.get("hidden_size", 768)))
    heads = int(raw.get("n_head", raw.get("num_attention_heads", 12)))
    layers = int(raw.get("n_layer", raw.get("num_hidden_layers", 12)))
    inner = raw.get("n_inner")
    return dict(
        hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=heads,
        head_dim=hidden // heads, intermediate_size=int(inner) if inner else 4 * hidden,
        max_position_embeddings=int(raw.get("n_positions", raw.get("max_position_embeddings", 1024))),
        norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
        attention_bias=True, o_proj_bias=True, mlp_bias=True,
        hidden_act=str(raw.get("activation_function", "gelu_new")),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        layer_types=("full_attention",) * layers,
    )
