"""``StageBackend``: a peer's blocks and the batching queue that runs them on one compute thread."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)


@dataclass
class _Task:
    hidden: torch.Tensor
    start: int
    end: int
    future: asyncio.Future = field(repr=False)

    @property
    def batch_key(self) -> tuple:
        return self.start, self.end, self.hidden.shape[1:], self.hidden.dtype


class StageBackend:
    """Holds blocks ``[start, end)`` of a model and runs forwards for them.

    Requests that are waiting when the compute thread frees up, and that have the same blocks, sequence
    length and dtype, are concatenated along the batch axis and run as one forward (up to
    ``max_batch_size`` rows).
    """

    def __init__(self, blocks, *, start: int, device: torch.device, dtype: torch.dtype, max_batch_size: int):
        self.blocks, self.start, self.end = blocks, start, start + len(blocks)
        self.device, self.dtype, self.max_batch_size = device, dtype, max_batch_size
        self._queue: asyncio.Queue[_Task] = asyncio.Queue()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-compute")
        self._runner: asyncio.Task | None = None
        self.batches_run = 0  # for tests and the status page

    async def launch(self) -> None:
        """Start the batching loop (call from the serving event loop)."""
        self._runner = asyncio.create_task(self._run())

    async def shutdown(self) -> None:
        if self._runner is not None:
            self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def forward(self, hidden: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Hidden states ``[batch, seq, hidden]`` through blocks ``[start, end)``; validated by the caller."""
        future = asyncio.get_running_loop().create_future()
        await self._queue.put(_Task(hidden, start, end, future))
        return await future

    async def _run(self) -> None:
        pending: list[_Task] = []
        while True:
            if not pending:
                pending.append(await self._queue.get())
            while not self._queue.empty():
                pending.append(self._queue.get_nowait())
            pending = [t for t in pending if not t.future.done()]  # callers that timed out
            if not pending:
                continue
            batch, rows, key = [], 0, pending[0].batch_key
            for task in pending:
                # the first task always runs, even alone above max_batch_size: an empty batch would kill this loop
                if task.batch_key == key and (not batch or rows + len(task.hidden) <= self.max_batch_size):
                    batch.append(task)
                    rows += len(task.hidden)
            pending = [t for t in pending if t not in batch]
            try:
                outputs = await asyncio.get_running_loop().run_in_executor(self._executor, self._compute, batch)
            except Exception as e:
                logger.exception("Forward of blocks %d:%d failed", batch[0].start, batch[0].end)
                for task in batch:
                    if not task.future.done():
                        task.future.set_exception(RuntimeError(f"forward failed on this peer: {e}"))
                continue
            for task, output in zip(batch, outputs, strict=True):
                if not task.future.done():
                    task.future.set_result(output)

    @torch.inference_mode()
    def _compute(self, batch: list[_Task]) -> list[torch.Tensor]:
        self.batches_run += 1
        hidden = torch.cat([t.hidden for t in batch]).to(self.device, self.dtype)
        batch_size, seq_len = hidden.shape[:2]
        position_ids = torch.arange(seq_len, device=self.device).expand(batch_size, seq_len)
        first, last = batch[0].start - self.start, batch[0].end - self.start
        for block in self.blocks[first:last]:
            hidden, _ = block(hidden, position_ids)
        hidden = hidden.to("cpu", batch[0].hidden.dtype)
        return list(hidden.split([len(t.hidden) for t in batch]))
