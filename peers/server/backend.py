"""``StageBackend``: a peer's blocks and the batching queue that runs them on one compute thread."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from peers.model.adapters import Active, using
from peers.server import metrics
from peers.server.kv_sessions import Session

logger = logging.getLogger(__name__)

# Batches of at most this many tokens run on the event loop's thread: handing a few-millisecond compute to
# a worker thread costs about as much again (GIL hand-offs between many small torch ops). Larger batches
# run on the compute thread so that the peer keeps answering while it works.
INLINE_TOKENS = 64


@dataclass(eq=False)  # identity: tasks hold tensors, which do not compare to a bool
class _Task:
    hidden: torch.Tensor
    start: int
    end: int
    future: asyncio.Future = field(repr=False)
    session: Session | None = None  # an inference step, else a stateless forward
    owner: str = ""  # the client (peer id) it runs for: batches take turns between clients
    adapter: Active | None = field(default=None, repr=False)  # LoRA active for this task only (never shared)

    @property
    def batch_key(self) -> tuple:
        seq = self.hidden.shape[1]
        return (self.session is not None, self.start, self.end, seq, self.hidden.shape[2:], self.hidden.dtype,
                id(self.adapter))  # only tasks with the same adapter (or none) share a batch


class StageBackend:
    """Holds blocks ``[start, end)`` of a model and runs forwards and inference steps for them.

    Tasks that are waiting when the compute thread frees up, and that have the same kind, blocks, number of
    new tokens and dtype, are concatenated along the batch axis and run as one forward (up to
    ``max_batch_tokens`` tokens). Inference steps of sessions whose caches differ in length are batched
    with left padding and a key mask. Clients take turns: each batch starts with the oldest task of the client
    served least recently and is filled round-robin between clients, so that one client's flood of work delays
    another's next task by at most one batch per client with work waiting.
    """

    def __init__(
        self, blocks, *, start: int, device: torch.device, dtype: torch.dtype, max_batch_tokens: int = 2048,
        active_sessions=lambda: 0,
    ):
        self.blocks, self.start, self.end = blocks, start, start + len(blocks)
        self.device, self.dtype, self.max_batch_tokens = device, dtype, max_batch_tokens
        self.active_sessions = active_sessions  # how many inference steps may be on their way
        self._spans: dict[tuple[int, int], object] = {}
        self._queue: asyncio.Queue[_Task] = asyncio.Queue()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-compute")
        self._runner: asyncio.Task | None = None
        self._served: dict[str, int] = {}  # client -> the last batch that ran one of its tasks
        self._batch_number = itertools.count(1)
        self.batches_run = 0  # for tests and the status page
        self.inference_steps = self.inference_batches = 0
        self.in_flight = 0  # forwards and steps submitted and not answered yet

    async def launch(self) -> None:
        """Start the batching loop (call from the serving event loop)."""
        self._runner = asyncio.create_task(self._run())

    async def shutdown(self) -> None:
        if self._runner is not None:
            self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def forward(self, hidden: torch.Tensor, start: int, end: int, owner: str = "",
                      adapter: Active | None = None) -> torch.Tensor:
        """Hidden states ``[batch, seq, hidden]`` through blocks ``[start, end)`` for client ``owner`` (with
        ``adapter`` active, if given); validated by the caller."""
        return await self._submit(_Task(hidden, start, end, asyncio.get_running_loop().create_future(),
                                        owner=owner, adapter=adapter))

    async def inference_step(self, session: Session, hidden: torch.Tensor, position: int) -> torch.Tensor:
        """Tokens ``[position, position + T)`` of ``session`` through its blocks, extending its KV cache.

        A ``position`` below the session's length first rolls the cache back to it. Validated by the caller.
        """
        session.truncate(position)
        task = _Task(hidden, session.start, session.end, asyncio.get_running_loop().create_future(), session,
                     session.owner, session.adapter)
        return await self._submit(task)

    async def drain(self, timeout: float) -> bool:
        """Wait until every forward and step submitted so far is answered (at most ``timeout`` s): a peer that moved
        lets the work of its old span finish before it frees the blocks. True if it did."""
        give_up = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < give_up:
            await asyncio.sleep(0.05)
        return not self.in_flight

    async def _submit(self, task: _Task) -> torch.Tensor:
        self.in_flight += 1
        try:
            await self._queue.put(task)
            return await task.future
        finally:
            self.in_flight -= 1

    async def _run(self) -> None:
        pending: list[_Task] = []
        while True:
            if not pending:
                pending.append(await self._queue.get())
                await self._gather_window()
            while not self._queue.empty():
                pending.append(self._queue.get_nowait())
            pending = [t for t in pending if not t.future.done()]  # callers that timed out
            if not pending:
                continue
            batch, pending = self._next_batch(pending)
            compute = self._compute_inference if batch[0].session is not None else self._compute_forward
            try:
                if sum(t.hidden.shape[0] * t.hidden.shape[1] for t in batch) <= INLINE_TOKENS:
                    outputs = compute(batch)  # small: a thread hand-off would cost more than the compute
                else:
                    outputs = await asyncio.get_running_loop().run_in_executor(self._executor, compute, batch)
            except Exception as e:
                logger.exception("Compute of blocks %d:%d failed", batch[0].start, batch[0].end)
                for task in batch:
                    if not task.future.done():
                        task.future.set_exception(RuntimeError(f"compute failed on this peer: {e}"))
                continue
            for task, output in zip(batch, outputs, strict=True):
                if not task.future.done():
                    task.future.set_result(output)

    def _next_batch(self, pending: list[_Task]) -> tuple[list[_Task], list[_Task]]:
        """The batch to run next and the tasks left: clients in turn, least recently served first."""
        by_owner: dict[str, list[_Task]] = {}
        for task in pending:
            by_owner.setdefault(task.owner, []).append(task)
        owners = sorted(by_owner, key=lambda o: self._served.get(o, 0))  # stable: ties keep arrival order
        turns = [t for round_ in itertools.zip_longest(*(by_owner[o] for o in owners)) for t in round_
                 if t is not None]
        batch, tokens, key = [], 0, turns[0].batch_key
        for task in turns:
            size = task.hidden.shape[0] * task.hidden.shape[1]
            # the first task always runs, even alone above the limit: an empty batch would kill this loop
            if task.batch_key == key and (not batch or tokens + size <= self.max_batch_tokens):
                batch.append(task)
                tokens += size
        number = next(self._batch_number)
        for task in batch:
            self._served[task.owner] = number
        if len(self._served) > 4096:  # forget clients with nothing queued
            self._served = {o: n for o, n in self._served.items() if o in by_owner}
        chosen = {id(t) for t in batch}
        return batch, [t for t in pending if id(t) not in chosen]

    async def _gather_window(self, max_rounds: int = 4) -> None:
        """Let the other parts of a multi-session message reach the queue before a batch is formed.

        A client sends the concurrent steps of its sessions in one message, and the handler submits them
        together: they arrive within a few event-loop turns. Waiting longer for other clients would only add
        latency (they come when they come), so the window stops as soon as a turn adds nothing.
        """
        if self.active_sessions() <= 1:
            return
        size = self._queue.qsize()
        for _ in range(max_rounds):
            await asyncio.sleep(0)
            if self._queue.qsize() == size:
                return
            size = self._queue.qsize()

    def _span(self, task: _Task):
        span = self._spans.get((task.start, task.end))
        if span is None:  # slicing builds a module list: once per span, not per step
            span = self._spans[task.start, task.end] = self.blocks[task.start - self.start : task.end - self.start]
        return span

    @torch.inference_mode()
    def _compute_forward(self, batch: list[_Task]) -> list[torch.Tensor]:
        self.batches_run += 1
        metrics.batch_done("forward", len(batch), sum(len(t.hidden) for t in batch))
        hidden = torch.cat([t.hidden for t in batch]).to(self.device, self.dtype)
        batch_size, seq_len = hidden.shape[:2]
        position_ids = torch.arange(seq_len, device=self.device).expand(batch_size, seq_len)
        with using(batch[0].adapter):  # the batch's adapter (all its tasks have the same), this call only
            for block in self._span(batch[0]):
                hidden, _ = block(hidden, position_ids)
        hidden = hidden.to("cpu", batch[0].hidden.dtype)
        return list(hidden.split([len(t.hidden) for t in batch]))

    @torch.inference_mode()
    def _compute_inference(self, batch: list[_Task]) -> list[torch.Tensor]:
        self.batches_run += 1
        self.inference_batches += 1
        self.inference_steps += len(batch)
        metrics.batch_done("inference", len(batch), sum(len(t.hidden) for t in batch))
        sessions = [t.session for t in batch]
        hidden = torch.cat([t.hidden for t in batch]).to(self.device, self.dtype)
        new = hidden.shape[1]
        longest = max(s.length for s in sessions)
        position_ids = torch.cat([
            torch.arange(s.length, s.length + new, device=self.device).expand(len(t.hidden), new)
            for s, t in zip(sessions, batch, strict=True)
        ])
        key_mask = None
        if any(s.length != longest for s in sessions):
            key_mask = torch.cat([_left_pad_mask(s.length, longest, new, len(t.hidden), self.device)
                                  for s, t in zip(sessions, batch, strict=True)])
        blocks = self._span(batch[0])
        new_past: list[list] = [[] for _ in sessions]
        for i, block in enumerate(blocks):
            past = _batched_past(sessions, i, longest) if longest else None
            with using(batch[0].adapter):  # the batch's adapter (all its tasks have the same), this call only
                hidden, (k, v) = block(hidden, position_ids, past, key_mask)
            if len(batch) == 1:  # k, v are fresh tensors: keep them without a copy
                new_past[0].append((k, v))
                continue
            offset = 0
            for j, (s, t) in enumerate(zip(sessions, batch, strict=True)):
                rows = slice(offset, offset + len(t.hidden))
                skip = longest - s.length  # left padding of this session
                # views, not copies: the next step concatenates them into fresh tensors anyway
                new_past[j].append((k[rows, :, skip:], v[rows, :, skip:]))
                offset += len(t.hidden)
        for s, past in zip(sessions, new_past, strict=True):
            s.past, s.length = past, s.length + new
        hidden = hidden.to("cpu", batch[0].hidden.dtype)
        return list(hidden.split([len(t.hidden) for t in batch]))


def _left_pad_mask(length: int, longest: int, new: int, rows: int, device) -> torch.Tensor:
    mask = torch.ones(rows, longest + new, dtype=torch.bool, device=device)
    mask[:, : longest - length] = False
    return mask


def _batched_past(sessions: list[Session], block: int, longest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block ``block``'s caches of all sessions, left-padded with zeros to ``longest`` and concatenated."""
    keys, values = [], []
    for s in sessions:
        if s.length == 0:
            ref = next(x.past[block][0] for x in sessions if x.length)
            shape = (s.batch_size, ref.shape[1], longest, ref.shape[3])
            keys.append(ref.new_zeros(shape))
            values.append(ref.new_zeros(shape))
            continue
        k, v = s.past[block]
        pad = longest - s.length
        if pad:
            k = torch.cat([k.new_zeros(*k.shape[:2], pad, k.shape[3]), k], dim=2)
            v = torch.cat([v.new_zeros(*v.shape[:2], pad, v.shape[3]), v], dim=2)
        keys.append(k)
        values.append(v)
    if len(sessions) == 1:
        return keys[0], values[0]
    return torch.cat(keys), torch.cat(values)
