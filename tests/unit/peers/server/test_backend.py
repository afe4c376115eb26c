"""StageBackend in-process: batching of concurrent requests, batch limits, sub-spans."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from peers.model import StageBlocks, load_blocks
from peers.server.backend import StageBackend
from peers.server.kv_sessions import Session

HIDDEN = 64  # the tiny Llama of tests/conftest.py
TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny matrices: a second intra-op thread only adds hand-offs, and stalls when the CPUs are busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def blocks(llama_dir):
    return load_blocks(llama_dir, 0, 8)


def reference(blocks, hidden: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Blocks [start, end) of a 0-based StageBlocks, run directly (no backend)."""
    batch, seq = hidden.shape[:2]
    positions = torch.arange(seq).expand(batch, seq)
    with torch.inference_mode():
        for block in blocks[start:end]:
            hidden, _ = block(hidden, positions)
    return hidden


class Recording(torch.nn.Module):
    """A block that notes which batch (``backend.batches_run``) called it, with which input."""

    def __init__(self, block: torch.nn.Module, index: int, recorder: Recorder) -> None:
        super().__init__()
        self.block, self.index, self.recorder = block, index, recorder

    def forward(self, hidden, *args, **kwargs):
        batch = self.recorder.backend.batches_run
        self.recorder.calls.append((batch, self.index, tuple(hidden.shape), hidden.dtype))
        return self.block(hidden, *args, **kwargs)


class Recorder:
    """Wraps each block to record the batches a backend runs: their rows, input shapes and blocks."""

    def __init__(self, blocks: StageBlocks) -> None:
        self.calls: list[tuple] = []
        self.backend: StageBackend | None = None
        wrapped = [Recording(b, blocks.start + i, self) for i, b in enumerate(blocks)]
        self.blocks = StageBlocks(wrapped, blocks.start, blocks.end)

    @property
    def batches(self) -> list[dict]:
        """One dict per batch, in order: ``rows``, ``inputs`` (shape, dtype) and ``blocks`` it ran through."""
        by_batch: dict[int, dict] = {}
        for batch, index, shape, dtype in self.calls:
            entry = by_batch.setdefault(batch, {"rows": shape[0], "inputs": set(), "blocks": []})
            entry["inputs"].add((shape, dtype))
            entry["blocks"].append(index)
        return [by_batch[k] for k in sorted(by_batch)]

    @property
    def rows(self) -> list[int]:
        return [b["rows"] for b in self.batches]


def run_backend(blocks, body, *, start: int = 0, max_batch_tokens: int = 2048):
    """Run ``await body(backend, recorder)`` against a launched backend, always shutting it down."""

    async def main():
        recorder = Recorder(blocks)
        backend = StageBackend(recorder.blocks, start=start, device=torch.device("cpu"), dtype=torch.float32,
                               max_batch_tokens=max_batch_tokens)
        recorder.backend = backend
        await backend.launch()
        try:
            return await asyncio.wait_for(body(backend, recorder), timeout=30)
        finally:
            await backend.shutdown()

    return asyncio.run(main())


def inputs(shapes: list[tuple[int, int]], seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, seq, HIDDEN, generator=gen) for rows, seq in shapes]


@pytest.mark.parametrize(
    "requests, rows, seq, max_batch_size",
    [
        (6, 1, 5, 8),  # all in one batch
        (6, 1, 5, 6),
        (6, 1, 5, 4),  # 4 + 2
        (6, 2, 3, 5),  # 2 requests (4 rows) per batch: 3 batches
        (5, 3, 7, 8),  # 2 + 2 + 1 requests
        (8, 1, 1, 3),  # 3 + 3 + 2
    ],
)
def test_concurrent_requests_are_batched(blocks, requests, rows, seq, max_batch_size):
    hidden = inputs([(rows, seq)] * requests)

    async def body(backend, recorder):
        alone = [await backend.forward(h, 0, 8) for h in hidden]
        assert backend.batches_run == requests
        together = await asyncio.gather(*(backend.forward(h, 0, 8) for h in hidden))
        return alone, together, backend.batches_run - requests, recorder.rows[requests:]

    alone, together, batches, batch_rows = run_backend(blocks, body, max_batch_tokens=max_batch_size * seq)
    per_batch = max_batch_size // rows
    assert batches == math.ceil(requests / per_batch) < requests
    assert all(r <= max_batch_size for r in batch_rows)
    assert sum(batch_rows) == requests * rows
    for h, a, t in zip(hidden, alone, together, strict=True):
        assert t.shape == h.shape and t.dtype == h.dtype
        assert (a - t).abs().max().item() < TOL
        assert (reference(blocks, h, 0, 8) - t).abs().max().item() < TOL


@pytest.mark.parametrize(
    "shapes, spans, expected_batches",
    [
        # different sequence lengths are never concatenated
        ([(1, 3), (1, 5), (1, 3), (1, 5), (1, 7)], [(0, 8)] * 5, 3),
        ([(2, 4), (2, 6)], [(0, 8)] * 2, 2),
        # different block spans neither
        ([(1, 4)] * 4, [(0, 8), (2, 5), (0, 8), (2, 5)], 2),
        ([(1, 4)] * 3, [(0, 8), (0, 7), (1, 8)], 3),
        # both
        ([(1, 4), (1, 4), (1, 6), (1, 6)], [(0, 4), (4, 8), (0, 4), (0, 4)], 3),
    ],
)
def test_incompatible_requests_are_not_mixed(blocks, shapes, spans, expected_batches):
    hidden = inputs(shapes, seed=1)

    async def body(backend, recorder):
        outputs = await asyncio.gather(*(backend.forward(h, s, e) for h, (s, e) in zip(hidden, spans, strict=True)))
        return outputs, recorder.batches

    outputs, batches = run_backend(blocks, body)
    assert len(batches) == expected_batches
    for batch in batches:
        assert len(batch["inputs"]) == 1, f"a batch mixes inputs {batch['inputs']}"
        assert batch["blocks"] in [list(range(s, e)) for s, e in spans], f"a batch mixes spans {batch['blocks']}"
    for h, (s, e), out in zip(hidden, spans, outputs, strict=True):
        assert (reference(blocks, h, s, e) - out).abs().max().item() < TOL


def test_dtypes_are_not_mixed(blocks):
    """Inputs of another dtype are computed in the backend's dtype and returned in their own."""
    h32, h16 = inputs([(1, 4), (1, 4)], seed=2)
    h16 = h16.to(torch.bfloat16)

    async def body(backend, recorder):
        return await asyncio.gather(backend.forward(h32, 0, 8), backend.forward(h16, 0, 8)), len(recorder.batches)

    (o32, o16), batches = run_backend(blocks, body)
    assert batches == 2
    assert o32.dtype == torch.float32 and o16.dtype == torch.bfloat16
    assert (reference(blocks, h32, 0, 8) - o32).abs().max().item() < TOL
    expected16 = reference(blocks, h16.float(), 0, 8).to(torch.bfloat16)
    assert (expected16.float() - o16.float()).abs().max().item() < 0.05


@pytest.mark.parametrize(
    "request_rows, max_batch_size, expected_rows",
    [
        ([1] * 10, 4, [4, 4, 2]),
        ([3, 3, 3], 4, [3, 3, 3]),  # 6 rows would exceed 4
        ([3, 1, 3, 1], 4, [4, 4]),  # a later request that fits joins the batch
        ([2, 2, 2, 2], 8, [8]),
        ([5, 1], 4, [5, 1]),  # a request above the limit runs alone instead of stalling the queue
        ([1, 6, 1], 4, [2, 6]),
    ],
)
def test_rows_beyond_max_batch_size_are_split(blocks, request_rows, max_batch_size, expected_rows):
    hidden = inputs([(rows, 3) for rows in request_rows], seed=3)

    async def body(backend, recorder):
        return await asyncio.gather(*(backend.forward(h, 1, 6) for h in hidden)), recorder.rows

    outputs, rows = run_backend(blocks, body, max_batch_tokens=max_batch_size * 3)  # 3 tokens per row
    assert rows == expected_rows
    for h, out in zip(hidden, outputs, strict=True):
        assert out.shape == h.shape
        assert (reference(blocks, h, 1, 6) - out).abs().max().item() < TOL


@pytest.mark.parametrize("span", [(0, 8), (0, 1), (3, 5), (7, 8), (2, 7)])
def test_sub_span(blocks, span):
    (hidden,) = inputs([(2, 6)], seed=4)

    async def body(backend, recorder):
        return await backend.forward(hidden, *span)

    out = run_backend(blocks, body)
    expected = reference(blocks, hidden, *span)
    assert (expected - out).abs().max().item() < TOL
    assert (out - hidden).abs().max().item() > 1e-3  # the blocks really ran


@pytest.mark.parametrize("span", [(2, 6), (3, 5), (5, 6), (2, 3)])
def test_sub_span_of_backend_not_starting_at_zero(llama_dir, blocks, span):
    """A backend holding blocks 2:6 takes absolute block indices."""
    partial = load_blocks(llama_dir, 2, 6)
    (hidden,) = inputs([(1, 5)], seed=5)

    async def body(backend, recorder):
        assert (backend.start, backend.end) == (2, 6)
        return await backend.forward(hidden, *span)

    out = run_backend(partial, body, start=2)
    assert (reference(blocks, hidden, *span) - out).abs().max().item() < TOL


def test_cancelled_caller_does_not_block_others(blocks):
    """A request whose caller gave up is skipped; the others are still answered."""
    hidden = inputs([(1, 4)] * 3, seed=6)

    async def body(backend, recorder):
        first = asyncio.ensure_future(backend.forward(hidden[0], 0, 8))
        others = [asyncio.ensure_future(backend.forward(h, 0, 8)) for h in hidden[1:]]
        await asyncio.sleep(0)
        first.cancel()
        return await asyncio.gather(*others)

    outputs = run_backend(blocks, body)
    for h, out in zip(hidden[1:], outputs, strict=True):
        assert (reference(blocks, h, 0, 8) - out).abs().max().item() < TOL


def test_failed_forward_fails_only_its_batch(blocks):
    """A forward that raises is reported to its callers; the loop keeps serving."""
    good, bad = inputs([(1, 4), (1, 4)], seed=7)
    bad = bad[..., : HIDDEN // 2]  # wrong hidden size: the blocks raise

    async def body(backend, recorder):
        with pytest.raises(RuntimeError, match="failed on this peer"):
            await backend.forward(bad, 0, 8)
        return await backend.forward(good, 0, 8)

    out = run_backend(blocks, body)
    assert (reference(blocks, good, 0, 8) - out).abs().max().item() < TOL


@pytest.mark.parametrize("kind", ["forward", "step"])
def test_finding_11_one_clients_flood_does_not_starve_another(blocks, kind):
    """Client A queues 12 tasks of a full batch each, then B one: B runs in the second batch, not the 13th."""
    flood, seq = 12, 4
    hidden = inputs([(1, seq)] * (flood + 1), seed=8)

    async def body(backend, recorder):
        finished: list[str] = []

        async def call(owner: str, index: int) -> torch.Tensor:
            if kind == "forward":
                out = await backend.forward(hidden[index], 0, 8, owner)
            else:
                session = Session(f"{owner}{index}", owner, 0, 8, 16, 1)
                out = await backend.inference_step(session, hidden[index], 0)
            finished.append(owner)
            return out

        calls = [asyncio.ensure_future(call("A", i)) for i in range(flood)]
        calls.append(asyncio.ensure_future(call("B", flood)))  # queued behind all of A's work
        outputs = await asyncio.gather(*calls)
        return finished, outputs, len(recorder.batches)

    finished, outputs, batches = run_backend(blocks, body, max_batch_tokens=seq)  # one task per batch
    assert batches == flood + 1
    assert finished.index("B") <= 1, finished  # A's flood delays B by at most one batch
    for h, out in zip(hidden, outputs, strict=True):
        assert (reference(blocks, h, 0, 8) - out).abs().max().item() < TOL


def test_finding_11_clients_share_a_full_batch_in_turn(blocks):
    """A batch that cannot take every waiting task takes them round-robin between clients."""
    hidden = inputs([(1, 2)] * 8, seed=9)
    owners = ["A"] * 6 + ["B", "C"]

    async def body(backend, recorder):
        finished: list[str] = []

        async def call(h: torch.Tensor, owner: str) -> None:
            await backend.forward(h, 0, 8, owner)
            finished.append(owner)

        await asyncio.gather(*(call(h, o) for h, o in zip(hidden, owners, strict=True)))
        return finished, recorder.rows

    finished, rows = run_backend(blocks, body, max_batch_tokens=8)  # 4 tasks per batch
    assert rows == [4, 4]
    assert sorted(finished[:4]) == ["A", "A", "B", "C"], finished  # not A's first four
