"""Shared helpers for comparing our block code with transformers on tiny random models."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from peers.model import LocalModel, ModelConfig, load_blocks, load_client_parts

TOL = 1e-4
SEQ = 12
CHUNKS = [(0, 5), (5, 8), (8, 9), (9, 10), (10, 11), (11, 12)]  # prefill, a 3-token chunk, then one by one


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Give every parameter (biases and norms included) non-trivial random values."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name or ".ln_" in name:
                p.copy_(1.0 + 0.1 * noise if name.endswith("weight") else 0.1 * noise)
            else:
                p.copy_(0.05 * noise)


def _hf_stepwise(hf: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits when fed ``ids`` in CHUNKS with its own KV cache."""
    # transformers >= 5.2x names the cache argument ``cache``; older versions ``past_key_values``
    arg = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    past, logits = None, []
    for a, b in CHUNKS:
        out = hf(ids[:, a:b], use_cache=True, **{arg: past})
        past = out[arg]
        logits.append(out.logits)
    return torch.cat(logits, dim=1)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def check_against_hf(hf: torch.nn.Module, model_dir: Path, split: int, *, cache_vs_full: bool = True) -> None:
    """Our LocalModel and a two-stage chain [0, split) + [split, N) reproduce transformers' logits.

    With ``cache_vs_full`` our cached, chunked run is also compared with transformers' single full pass
    (not valid for dynamic RoPE, whose frequencies depend on the length seen so far).
    """
    cfg = ModelConfig.from_dir(model_dir)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (2, SEQ), generator=gen)
    hf.eval()
    with torch.no_grad():
        ref_full = hf(ids).logits
        ref_steps = _hf_stepwise(hf, ids)
        assert ref_full.std() > 0.05, "logits too flat for the comparison to mean anything"
        local = LocalModel.from_dir(model_dir)
        logits, past = local(ids)
        assert _max_diff(logits, ref_full) < TOL
        assert len(past) == cfg.num_layers
        assert past[0][0].shape == (2, cfg.num_kv_heads, SEQ, cfg.head_dim)

        emb, head = load_client_parts(model_dir)
        stages = [load_blocks(model_dir, 0, split), load_blocks(model_dir, split, cfg.num_layers)]
        pasts: list = [None, None]
        chain_full, local_steps, chain_steps, local_past = None, [], [], None
        for a, b in [(0, SEQ), *CHUNKS]:
            pos = torch.arange(a, b).expand(2, b - a)
            h = emb.embed(ids[:, a:b], pos)
            for s, stage in enumerate(stages):
                h, kv = stage(h, pos, None if (a, b) == (0, SEQ) else pasts[s])
                if (a, b) != (0, SEQ):
                    pasts[s] = kv
            if (a, b) == (0, SEQ):
                chain_full = head.head(h)
                continue
            chain_steps.append(head.head(h))
            step_logits, local_past = local(ids[:, a:b], past=local_past)
            local_steps.append(step_logits)
        assert _max_diff(chain_full, ref_full) < TOL
        for steps in (torch.cat(local_steps, 1), torch.cat(chain_steps, 1)):
            assert _max_diff(steps, ref_steps) < TOL
            if cache_vs_full:
                assert _max_diff(steps, ref_full) < TOL
        assert pasts[1][0][0].shape[2] == SEQ


@pytest.fixture
def hf_check() -> Callable[..., None]:
    return check_against_hf


@pytest.fixture
def randomize() -> Callable[..., None]:
    return randomize_
