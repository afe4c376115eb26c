"""Inference steps of sessions with caches of different lengths, batched with left padding, are exact."""

from __future__ import annotations

import asyncio

import torch

from peers.model import load_blocks
from peers.server.backend import StageBackend
from peers.server.kv_sessions import Session


def _reference(blocks, inputs: list[torch.Tensor]) -> torch.Tensor:
    """The whole sequence at once, no cache: the outputs every incremental run must reproduce."""
    x = torch.cat(inputs, dim=1)
    out, _ = blocks(x, torch.arange(x.shape[1])[None].expand(x.shape[0], -1))
    return out


def test_batched_sessions_of_different_lengths_match_separate_runs(llama_dir):
    torch.manual_seed(0)
    blocks = load_blocks(llama_dir, 0, 8)
    prompts = [torch.randn(1, n, 64) for n in (3, 7, 1, 5)]
    steps = [[torch.randn(1, 1, 64) for _ in range(4)] for _ in prompts]

    async def run():
        backend = StageBackend(blocks, start=0, device=torch.device("cpu"), dtype=torch.float32, max_batch_tokens=64)
        await backend.launch()
        sessions = [Session(f"s{i}", "owner", 0, 8, 64, 1) for i in range(len(prompts))]
        outs = [[await backend.inference_step(s, p, 0)] for s, p in zip(sessions, prompts, strict=True)]
        for k in range(4):  # all sessions step together: one batched forward with left padding
            results = await asyncio.gather(*(backend.inference_step(s, steps[i][k], s.length)
                                             for i, s in enumerate(sessions)))
            for i, r in enumerate(results):
                outs[i].append(r)
        await backend.shutdown()
        return outs, backend

    outs, backend = asyncio.run(run())
    assert backend.inference_batches < backend.inference_steps  # steps really were batched
    with torch.inference_mode():
        for prompt, extra, got in zip(prompts, steps, outs, strict=True):
            expected = _reference(blocks, [prompt, *extra])
            assert (torch.cat(got, dim=1) - expected).abs().max().item() < 1e-4


def test_rollback_recomputes_from_a_position(llama_dir):
    blocks = load_blocks(llama_dir, 2, 5)
    a, b, c = torch.randn(1, 4, 64), torch.randn(1, 2, 64), torch.randn(1, 3, 64)

    async def run():
        backend = StageBackend(blocks, start=2, device=torch.device("cpu"), dtype=torch.float32, max_batch_tokens=64)
        await backend.launch()
        session = Session("s", "owner", 2, 5, 32, 1)
        await backend.inference_step(session, a, 0)
        await backend.inference_step(session, b, 4)
        out = await backend.inference_step(session, c, 4)  # replaces b: the cache rolls back to 4 tokens
        await backend.shutdown()
        return out, session.length

    out, length = asyncio.run(run())
    assert length == 7
    with torch.inference_mode():
        expected = _reference(blocks, [a, c])[:, 4:]
    assert (out - expected).abs().max().item() < 1e-4
