"""Timing one block on this peer's device: what a peer announces as its compute (``swarm.measure.Compute``)."""

from __future__ import annotations

import torch

from peers.model import load_blocks
from swarm.measure import Compute, time_per_call

MEASURE_TOKENS = 128  # tokens per measured forward of one block


def compute_key(config, device: torch.device | str, dtype: torch.dtype | str) -> str:
    """The key a peer caches its block timing under (``swarm.measure.cached_compute``): model shape, device, dtype."""
    return (f"{config.family}-h{config.hidden_size}-i{config.intermediate_size}-kv{config.num_kv_heads}"
            f"-{device}-{dtype}")


def measure_loaded_block(model_dir, hidden_size: int, device: torch.device, dtype: torch.dtype) -> Compute:
    """``measure_block`` on block 0 loaded anew from ``model_dir`` (freed after): a timing that touches none of the
    blocks a peer serves (a backup has none; an idle re-timing must not change them)."""
    blocks = load_blocks(model_dir, 0, 1, device=device, dtype=dtype)
    return measure_block(blocks[0], hidden_size, device, dtype)


def measure_block(block, hidden_size: int, device: torch.device, dtype: torch.dtype,
                  tokens: int = MEASURE_TOKENS) -> Compute:
    """Median forward and backward time of ``block`` on ``tokens`` tokens, per token. The backward is that of the
    block's input and weights (as in training); the weights' grads are cleared and frozen again afterwards."""
    hidden = torch.randn(1, tokens, hidden_size, device=device, dtype=dtype)
    positions = torch.arange(tokens, device=device)[None]

    def synced(fn):  # a GPU runs kernels asynchronously: time them to their end, not to their launch
        if device.type != "cuda":
            return fn
        return lambda: (fn(), torch.cuda.synchronize(device))

    with torch.inference_mode():
        forward = time_per_call(synced(lambda: block(hidden, positions)))
    params = list(block.parameters())
    frozen = [not p.requires_grad for p in params]
    x = hidden.clone().requires_grad_(True)

    def forward_backward() -> None:
        out, _ = block(x, positions)
        out.float().sum().backward()

    try:
        for p in params:
            p.requires_grad_(True)
        with torch.enable_grad():
            both = time_per_call(synced(forward_backward), repeats=3)
            graph_forward = time_per_call(synced(lambda: block(x, positions)), repeats=3)
    finally:
        for p, was_frozen in zip(params, frozen, strict=True):
            p.grad = None
            if was_frozen:
                p.requires_grad_(False)
    backward = max(both - graph_forward, forward / 10)  # never 0: a noisy difference of two timings
    return Compute(forward / tokens, backward / tokens)
