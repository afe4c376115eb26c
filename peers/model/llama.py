"""Llama-family block (Llama 2/3, Qwen2, Mistral) and its client-side embedding and head.

Submodule names match Hugging Face's inside ``model.layers.{i}`` so that checkpoint tensors load
after stripping that prefix.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from .adapters import Projection
from .blocks import ACTIVATION_FNS, KV, append_kv, causal_attention
from .config import ModelConfig

logger = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like the reference implementation."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(config: ModelConfig, seq_len: int = 0) -> torch.Tensor:
    """Inverse RoPE frequencies (float32, ``[head_dim // 2]``) for the config's rope type.

    ``seq_len`` (max position + 1) only matters for "dynamic" NTK scaling.
    """
    dim, base = config.head_dim, config.rope_theta
    scaling = config.rope_scaling or {}
    rope_type = config.rope_type
    if rope_type == "dynamic" and seq_len > config.max_position_embeddings:
        factor, max_pos = float(scaling["factor"]), config.max_position_embeddings
        base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: slow the low frequencies, keep the high ones, blend between."""
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class Rotary(nn.Module):
    """Rotary position embedding; frequencies are cached per device (no state-dict entries)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self._cache: dict[torch.device, torch.Tensor] = {}

    def _inv_freq(self, position_ids: torch.Tensor) -> torch.Tensor:
        if self.config.rope_type == "dynamic":
            return rope_inv_freq(self.config, int(position_ids.max()) + 1).to(position_ids.device)
        dev = position_ids.device
        if dev not in self._cache:
            self._cache[dev] = rope_inv_freq(self.config).to(dev)
        return self._cache[dev]

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape ``[B, 1, T, head_dim]`` for broadcasting over heads."""
        freqs = position_ids[..., None].float() * self._inv_freq(position_ids)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaAttention(nn.Module):
    """Grouped-query attention with rotary embeddings and optional sliding window."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.window = config.sliding_window_for(layer_idx)
        self.q_proj = Projection(h, self.num_heads * d, bias=config.attention_bias)
        self.k_proj = Projection(h, self.num_kv_heads * d, bias=config.attention_bias)
        self.v_proj = Projection(h, self.num_kv_heads * d, bias=config.attention_bias)
        self.o_proj = Projection(self.num_heads * d, h, bias=config.o_proj_bias)
        self.rotary = Rotary(config)

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, past_kv: KV | None = None,
        key_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, KV]:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary(position_ids, x.dtype)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k, v = append_kv(past_kv, k, v)
        out = causal_attention(q, k, v, scale=self.head_dim**-0.5, window=self.window, key_mask=key_mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), (k, v)


class LlamaMLP(nn.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = Projection(h, i, bias=bias)
        self.up_proj = Projection(h, i, bias=bias)
        self.down_proj = Projection(i, h, bias=bias)
        self.act = ACTIVATION_FNS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """One decoder layer: pre-norm attention and pre-norm gated MLP, both residual."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self, hidden: torch.Tensor, position_ids: torch.Tensor, past_kv: KV | None = None,
        key_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, KV]:
        attn, kv = self.self_attn(self.input_layernorm(hidden), position_ids, past_kv, key_mask)
        hidden = hidden + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), kv


class LlamaEmbedding(nn.Module):
    """Token embedding (``model.embed_tokens``); positions enter later through RoPE."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.embed(input_ids, position_ids)


class LlamaHead(nn.Module):
    """Final RMSNorm (``model.norm``) and ``lm_head``, which may share the embedding matrix."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)
