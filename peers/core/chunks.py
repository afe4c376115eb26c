"""Sequences kept as chunks of hidden states (``[batch, T, hidden]`` each, in token order)."""

from __future__ import annotations

import torch


def first_tokens(chunks: list[torch.Tensor], position: int) -> list[torch.Tensor]:
    """The first ``position`` tokens of ``chunks``, as chunks (the last one cut)."""
    kept, total = [], 0
    for x in chunks:
        if total >= position:
            break
        kept.append(x[:, : position - total])
        total += kept[-1].shape[1]
    return kept
