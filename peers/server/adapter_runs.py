"""The adapter runs on one peer's blocks (issue 19): each LoRA run is a ``TrainingRPC`` of its own (``adapter_mode``),
by run id, next to the base training side; the blocks stay frozen and shared.

Access (``--adapters``, default ``anyone``): who may open adapter runs here. A run's adapters belong to the peer id
that opened it first: only that trainer may open it again, train it, fetch its adapters or generate with them; others
are told to pick another run id. At most ``max_runs`` runs are held; a new one replaces the longest idle run that no
trainer holds open (saved first when the peer has ``--checkpoint_dir``), else it is refused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from peers.core.trainers import TrainerPolicy
from peers.model.adapters import Active
from peers.model.blocks import StageBlocks
from peers.server.session_adapters import SessionAdapters
from peers.server.training_rpc import TrainingRPC
from peers.wire.errors import RequestError
from peers.wire.messages import ParamsPush, TrainOpen, TrainPush
from privacy.peer_ids import short_id

logger = logging.getLogger(__name__)

MAX_RUNS = 8


class AdapterRuns:
    """Adapter runs by run id; ``make()`` builds a fresh adapter-mode ``TrainingRPC`` on the peer's blocks."""

    def __init__(self, make: Callable[[], TrainingRPC], policy: TrainerPolicy, blocks: StageBlocks, *,
                 max_runs: int = MAX_RUNS) -> None:
        self.make, self.policy, self.max_runs = make, policy, max_runs
        self.sessions = SessionAdapters(blocks, self.run_adapter)  # what inference that names an adapter runs with
        self.runs: dict[str, TrainingRPC] = {}
        self.owners: dict[str, str] = {}  # run id -> the peer id whose adapters they are
        self.used: dict[str, float] = {}  # run id -> time.monotonic() of its last open

    def get(self, run_id: str) -> TrainingRPC | None:
        return self.runs.get(run_id)

    def run_adapter(self, caller: str, run_id: str) -> Active | None:
        """The current adapters of ``caller``'s own adapter run ``run_id`` here, for inference (None if none)."""
        rpc = self.runs.get(run_id)
        if rpc is None or self.owners.get(run_id) != caller or rpc.trainer is None or rpc.trainer.adapter is None:
            return None
        return rpc.trainer.adapter.deltas()

    def resolve(self, caller: str, name: str, start: int, end: int) -> Active | None:
        """What an inference request of ``caller`` naming adapter ``name`` runs with (``SessionAdapters``)."""
        if name and not self.policy.allows(caller):
            raise RequestError(f"this peer runs no adapters for peer {caller} (it allows {self.policy.describe()} "
                               "with --adapters)" if self.policy.enabled else
                               "this peer runs no adapters: its operator started it with --adapters none")
        return self.sessions.resolve(caller, name, start, end)

    def refusal(self, request: object, caller: str) -> str:
        """Why ``caller`` may not make this adapter-run request ('' if it may). An adjacent stage's push is checked by
        the run's chain (only the peers its trainer named)."""
        if isinstance(request, (TrainPush, ParamsPush)):
            return ""
        if not self.policy.enabled:
            return "this peer trains no adapters: its operator started it with --adapters none"
        if not self.policy.allows(caller):
            return (f"peer {caller} may not train adapters on this peer (it allows {self.policy.describe()}): its "
                    "operator must add your peer id to --adapters")
        run_id = getattr(request, "run_id", "")
        owner = self.owners.get(run_id)
        if owner is not None and owner != caller:
            return f"run {run_id[:64]!r} holds another trainer's adapters on this peer: pick another run id"
        return ""

    async def open(self, request: TrainOpen, stream: object, caller: str) -> int:
        """Open (or re-open) adapter run ``request.run_id`` for ``caller``; its step."""
        if refusal := self.refusal(request, caller):
            raise RequestError(refusal)
        rpc, new = self.runs.get(request.run_id), False
        if rpc is None:  # registered before the first await: a concurrent open of the same id by another is refused
            if len(self.runs) >= self.max_runs:
                self._evict()
            rpc, new = self.make(), True
            rpc.adapter_owner = caller
            self.runs[request.run_id], self.owners[request.run_id] = rpc, caller
        self.used[request.run_id] = time.monotonic()
        try:
            step = await rpc.open(request, stream)
        except BaseException:
            if new:
                self._forget(request.run_id)
                rpc.shutdown()
            raise
        if new:
            logger.info("Adapter run %r opened by %s (%s)", request.run_id, short_id(caller), request.adapter)
        return step

    def _forget(self, run_id: str) -> TrainingRPC | None:
        self.owners.pop(run_id, None)
        self.used.pop(run_id, None)
        return self.runs.pop(run_id, None)

    def _evict(self) -> None:
        idle = [run_id for run_id, rpc in self.runs.items() if rpc.owner is None]
        if not idle:
            raise RequestError(f"this peer holds {len(self.runs)} adapter runs in use (at most {self.max_runs}): "
                               "try later or another peer")
        run_id = min(idle, key=lambda r: self.used.get(r, 0.0))
        rpc = self._forget(run_id)
        assert rpc is not None
        rpc.save_unsaved("before making room for another adapter run")
        rpc.shutdown()
        logger.info("Adapter run %r: dropped (idle) to make room for another", run_id)

    def stream_closed(self, stream: object) -> None:
        for rpc in self.runs.values():
            rpc.stream_closed(stream)

    def save_all(self, why: str) -> list[Path]:
        return [path for rpc in self.runs.values() if (path := rpc.save_unsaved(why)) is not None]

    def shutdown(self) -> None:
        for rpc in self.runs.values():
            rpc.shutdown()

    async def retire(self, refusal: str) -> None:
        for rpc in list(self.runs.values()):
            await rpc.retire(refusal)
        self.runs.clear()
