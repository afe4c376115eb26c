"""Common block interface: the KV type, causal attention, activations and ``StageBlocks``.

Every transformer block (``LlamaBlock``, ``GPT2Block``) implements::

    forward(hidden [B, T, H], position_ids [B, T], past_kv: KV | None = None, key_mask=None)
        -> (hidden [B, T, H], KV)

where the returned KV is ``past_kv`` with this call's keys/values appended along the sequence axis.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

KV = tuple[torch.Tensor, torch.Tensor]  # (k, v), each [batch, num_kv_heads, seq, head_dim]
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)  # enable_gqa= exists


class Block(Protocol):
    """What a stage needs from a transformer block."""

    def __call__(
        self, hidden: torch.Tensor, position_ids: torch.Tensor, past_kv: KV | None = None,
        key_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, KV]: ...


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


ACTIVATION_FNS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def append_kv(past_kv: KV | None, k: torch.Tensor, v: torch.Tensor) -> KV:
    """Concatenate new keys/values ``[B, kv_heads, T, D]`` after the cached ones."""
    if past_kv is None:
        return k, v
    past_k, past_v = past_kv
    if past_k.shape[0] != k.shape[0] or past_k.shape[1] != k.shape[1] or past_k.shape[3] != k.shape[3]:
        raise ValueError(f"past_kv of shape {tuple(past_k.shape)} does not fit new keys {tuple(k.shape)}")
    return torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, window: int | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal SDPA of q ``[B, Hq, T, D]`` over k/v ``[B, Hkv, S, D]``, S = past + T.

    Query i sits at absolute position ``S - T + i`` and sees keys ``0 .. S - T + i`` (only the
    last ``window`` of them when a sliding window is set). ``key_mask`` ``[B, S]`` (True = a real key)
    hides padding, e.g. when sessions with caches of different lengths are batched with left padding.
    Returns ``[B, Hq, T, D]``.
    """
    t, s = q.shape[-2], k.shape[-2]
    past = s - t
    if past < 0:
        raise ValueError(f"{t} queries but only {s} keys")
    mask, is_causal = None, False
    if window is None and past == 0:
        is_causal = t > 1
    elif window is not None or t > 1:
        q_pos = torch.arange(past, s, device=q.device)[:, None]
        k_pos = torch.arange(s, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
    if key_mask is not None:
        if key_mask.shape != (q.shape[0], s):
            raise ValueError(f"key_mask must be [batch, {s}], got {tuple(key_mask.shape)}")
        if mask is None:
            q_pos = torch.arange(past, s, device=q.device)[:, None]
            mask = torch.arange(s, device=q.device)[None, :] <= q_pos
        mask, is_causal = mask[None, None] & key_mask[:, None, None, :], False
    if q.shape[1] == k.shape[1]:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
    if _SDPA_GQA:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True
        )
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)


class StageBlocks(nn.ModuleList):
    """A contiguous range ``[start, end)`` of transformer blocks, run one after another."""

    def __init__(self, blocks: Iterable[nn.Module], start: int, end: int) -> None:
        super().__init__(blocks)
        if len(self) != end - start:
            raise ValueError(f"got {len(self)} blocks for range [{start}, {end})")
        self.start, self.end = start, end

    def __getitem__(self, idx: int | slice) -> nn.Module:
        """A block, or for a slice a ``StageBlocks`` of the selected blocks (absolute indices kept)."""
        if not isinstance(idx, slice):
            return super().__getitem__(idx)
        first, last, step = idx.indices(len(self))
        mods = list(self._modules.values())[idx]
        if step != 1:
            return nn.ModuleList(mods)
        last = max(first, last)
        return StageBlocks(mods, self.start + first, self.start + last).train(self.training)

    def forward(
        self, hidden: torch.Tensor, position_ids: torch.Tensor, past: list[KV] | None = None
    ) -> tuple[torch.Tensor, list[KV]]:
        """Run all blocks; ``past`` holds one KV per block (or None for a fresh sequence)."""
        if past is not None and len(past) != len(self):
            raise ValueError(
                f"past has {len(past)} entries for {len(self)} blocks [{self.start}, {self.end})"
            )
        new_past: list[KV] = []
        for i, block in enumerate(self):
            hidden, kv = block(hidden, position_ids, None if past is None else past[i])
            new_past.append(kv)
        return hidden, new_past

    def extra_repr(self) -> str:
        return f"start={self.start}, end={self.end}"
