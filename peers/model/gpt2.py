"""GPT-2 block and its client-side embedding (wte + wpe) and head (ln_f + tied lm_head).

Projections keep Hugging Face's ``Conv1D`` layout (weight ``[in, out]``) so that checkpoint
tensors under ``transformer.h.{i}.`` (or ``h.{i}.``) load without transposing.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from .adapters import adapt
from .blocks import ACTIVATION_FNS, KV, append_kv, causal_attention
from .config import ModelConfig

logger = logging.getLogger(__name__)


class Conv1D(nn.Module):
    """Affine map ``x @ weight + bias`` with ``weight`` stored as ``[in_features, out_features]``; a LoRA may target
    it (the active adapter's term is added, ``peers.model.adapters``)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(out_features))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
        return adapt(self, x, out.view(*x.shape[:-1], self.weight.shape[1]))


class GPT2Attention(nn.Module):
    """Multi-head causal self-attention with a fused qkv projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.c_attn = Conv1D(h, 3 * h)
        self.c_proj = Conv1D(h, h)

    def forward(
        self, x: torch.Tensor, past_kv: KV | None = None, key_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, KV]:
        b, t, h = x.shape
        q, k, v = (
            z.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
            for z in self.c_attn(x).split(h, dim=-1)
        )
        k, v = append_kv(past_kv, k, v)
        out = causal_attention(q, k, v, scale=self.head_dim**-0.5, key_mask=key_mask)
        return self.c_proj(out.transpose(1, 2).reshape(b, t, h)), (k, v)


class GPT2MLP(nn.Module):
    """``c_proj(act(c_fc(x)))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.c_fc = Conv1D(config.hidden_size, config.intermediate_size)
        self.c_proj = Conv1D(config.intermediate_size, config.hidden_size)
        self.act = ACTIVATION_FNS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    """One GPT-2 layer: pre-LayerNorm attention and MLP, both residual."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = GPT2Attention(config)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = GPT2MLP(config)

    def forward(
        self, hidden: torch.Tensor, position_ids: torch.Tensor, past_kv: KV | None = None,
        key_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, KV]:
        attn, kv = self.attn(self.ln_1(hidden), past_kv, key_mask)
        hidden = hidden + attn
        return hidden + self.mlp(self.ln_2(hidden)), kv


class GPT2Embedding(nn.Module):
    """Token embedding ``wte`` plus learned absolute position embedding ``wpe``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
        if int(position_ids.max()) >= self.wpe.num_embeddings:
            raise ValueError(f"position {int(position_ids.max())} exceeds GPT-2's "
                             f"{self.wpe.num_embeddings} learned positions")
        return self.wte(input_ids) + self.wpe(position_ids)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.embed(input_ids, position_ids)


class GPT2Head(nn.Module):
    """Final LayerNorm ``ln_f`` and ``lm_head`` (normally tied to ``wte``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)
