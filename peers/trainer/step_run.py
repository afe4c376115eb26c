"""One step of a run as the trainer runs it (``StepRun``): its micro-batches' tasks, the weights they use, its record.

With staleness 0 a step uses the current weights everywhere. With staleness 1 (asynchronous steps) a step's
micro-batches use the weights every part had before it applied the previous step: the trainer's embedding and head run
on a kept copy of them (``peers.training.versions``), and each forward names the stage's step count to use
(``TrainForward.at_step``). The next step's first ``stale_upto`` micro-batches (None: all) are started while this one
drains: their forwards and losses run at once, their backwards wait (``ready``) until every part applied this step, so
that each step's gradients are summed apart; its other micro-batches wait for that before they start, and run on the
current weights, as in a synchronous step. A step started right after a (re-)opened run uses the current weights (the
stages' kept copies may be gone): after a failure the run goes on synchronously for one step.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable, Sequence

import torch

from peers.trainer.replay import StepRecord
from peers.training.versions import call_with

MicroBatch = Callable[["StepRun", torch.Tensor, int], Awaitable[float]]


class StepRun:
    """Step ``index`` over ``batches``: ``own`` (the trainer part's weights, None = its live parameters) and
    ``at_steps`` (peer id -> the stage step count its forwards use; absent = the current weights)."""

    def __init__(self, index: int, batches: Sequence[torch.Tensor], spans: list[tuple[int, int]], *,
                 params: list[torch.nn.Parameter], own: list[torch.Tensor] | None = None,
                 at_steps: dict[str, int] | None = None, attempt: int = 0, opened: int = 0, ready: bool = True,
                 stale_upto: int | None = None) -> None:
        self.index, self.batches, self.attempt, self.opened = index, batches, attempt, opened
        self.record = StepRecord(spans)
        self.stage_steps = [0] * len(spans)
        self.stage_busy = [0.0] * len(spans)
        self.live = params
        self.stale_upto = stale_upto  # micro-batches [0, stale_upto) use the old weights (None: all)
        self.params = params if own is None else own  # the leaves the trainer part's gradients are taken for
        self.own = None if own is None else {id(p): w for p, w in zip(params, own, strict=True)}
        self.at_steps = at_steps or {}
        self.ready = asyncio.Event()  # the previous step was applied everywhere: backwards may go
        if ready:
            self.ready.set()
        self.tasks: list[asyncio.Future] = []

    @property
    def stale(self) -> bool:
        return self.own is not None

    def stale_at(self, index: int) -> bool:
        """Whether micro-batch ``index`` runs on the old weights."""
        return self.own is not None and (self.stale_upto is None or index < self.stale_upto)

    def fresh(self) -> StepRun:
        """This step as its micro-batches on the current weights see it (the same record, counters and events)."""
        view = copy.copy(self)
        view.own, view.params, view.at_steps = None, self.live, {}
        return view

    def at_step(self, peer_id: str) -> int:
        return self.at_steps.get(peer_id, -1)

    def embed(self, embedding: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.own is None:
            return embedding.embed(input_ids, positions)
        return call_with(embedding, self.own, input_ids, positions, method="embed")

    def head(self, head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        if self.own is None:
            return head.head(hidden)
        return call_with(head, self.own, hidden, method="head")

    def start(self, gate: asyncio.Semaphore, micro_batch: MicroBatch) -> None:
        """Start every micro-batch (at most ``gate``'s count in flight, shared with the next step's)."""
        async def one(index: int, input_ids: torch.Tensor) -> float:
            run = self
            if self.own is not None and not self.stale_at(index):
                await self.ready.wait()  # the previous step is applied everywhere: on the current weights
                run = self.fresh()
            async with gate:
                return await micro_batch(run, input_ids, index)

        self.tasks = [asyncio.ensure_future(one(i, ids)) for i, ids in enumerate(self.batches)]

    async def losses(self) -> list[float]:
        """Each micro-batch's loss; the first failure cancels the others and raises."""
        try:
            return list(await asyncio.gather(*self.tasks))
        except BaseException:
            await self.cancel()
            raise

    async def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def before_backward(self) -> None:
        """Wait until the previous step is applied everywhere (staleness 1: this step started while it drained)."""
        await self.ready.wait()
