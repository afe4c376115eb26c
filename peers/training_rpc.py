"""The training side of a peer's stream: open a run, forward and backward micro-batches, step, checkpoint.

A peer trains its whole block span for one run at a time; the stream that opened the run owns it. The
peer owns its blocks' parameters and AdamW state (``peers.training.StageTrainer``) and steps when it has
seen the run's ``accumulation`` backward passes. If the owning stream ends mid-step, the partial gradients
are discarded: no half-applied update. The weights it trains are the ones it serves for inference.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from peers.averaging import ReplicaAverager, StreamFor
from peers.finite import all_finite
from peers.model.blocks import StageBlocks
from peers.protocol import (
    ParamsFetch,
    ParamsPush,
    RequestError,
    StageInfo,
    TrainApply,
    TrainBackward,
    TrainForward,
    TrainOpen,
)
from peers.training import GradientError, OptimConfig, StageTrainer
from peers.training.state import read_state_info

logger = logging.getLogger(__name__)

MAX_PENDING = 64  # micro-batches forwarded and not yet backwarded, per run


class TrainingRPC:
    """Serves training requests for one peer's blocks (``blocks`` is the backend's ``StageBlocks``)."""

    def __init__(self, blocks: StageBlocks, info: StageInfo, *, checkpoint_dir: Path | None = None,
                 stream_for: StreamFor | None = None, average_timeout: float = 30.0) -> None:
        self.blocks, self.info, self.checkpoint_dir = blocks, info, checkpoint_dir
        self.stream_for, self.average_timeout = stream_for, average_timeout  # streams to other peers (averaging)
        self.averager: ReplicaAverager | None = None
        self.average_every = 0
        self.trainer: StageTrainer | None = None
        self.run_id = ""
        self.owner: object | None = None  # the stream that opened the run
        self.checkpoint_every = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-train")

    @property
    def step(self) -> int:
        return 0 if self.trainer is None else self.trainer.step

    def open(self, request: TrainOpen, stream: object) -> int:
        """Join ``request.run_id`` (resuming from this peer's checkpoint if it has one); returns the step."""
        if (request.start, request.end) != (self.info.start, self.info.end):
            raise RequestError(f"training uses a peer's whole span: this peer serves {self.info.start}:"
                               f"{self.info.end}, not {request.start}:{request.end}")
        if self.owner is not None and self.owner is not stream and self.run_id != request.run_id:
            raise RequestError(f"this peer is training run {self.run_id!r} for another trainer; pick another peer")
        if not 1 <= request.accumulation <= 1 << 16 or request.checkpoint_every < 0 or request.run_step < 0:
            raise RequestError("accumulation must be in 1..65536, checkpoint_every and run_step >= 0")
        if not all(isinstance(p, str) for p in request.replicas):
            raise RequestError("replicas must be peer ids (strings)")
        if request.average_every and request.replicas and self.stream_for is None:
            raise RequestError("this peer cannot reach other peers to average with its replicas")
        try:
            optim = OptimConfig.from_dict(request.optim)
        except (TypeError, ValueError) as e:
            raise RequestError(f"bad optimizer config: {e}") from None
        if self.trainer is None or self.run_id != request.run_id:
            self.save_unsaved(f"before switching to run {request.run_id!r}")
            self.trainer = StageTrainer(self.blocks, optim, request.accumulation,
                                        keep_activations=request.keep_activations, max_pending=MAX_PENDING,
                                        auto_step=not request.explicit_apply)
            self.run_id = request.run_id
            path = self._checkpoint_path()
            if path is not None and (path / "state.json").is_file():
                self.trainer.load(path)
                logger.info("Run %r: resumed blocks %d:%d from %s at step %d", self.run_id, self.info.start,
                            self.info.end, path, self.trainer.step)
        else:
            self.trainer.reset_accumulation()  # a re-opened run starts its step afresh
            self.trainer.accumulation, self.trainer.auto_step = request.accumulation, not request.explicit_apply
            self.trainer.keep_activations = request.keep_activations
        if request.run_step > self.trainer.step and any(p != self.info.peer_id for p in request.replicas):
            # a replica joining (or rejoining) a run under way counts from the run's step, so its lr schedule and
            # averaging rounds match the others'; its weights are a replica's (fetched at start) or its own, and
            # the next averaging round brings them in line. A lone stage keeps its count: a mismatch shows.
            logger.info("Run %r: joined at step %d (from %d) to match the other replicas; AdamW state kept as is",
                        self.run_id, request.run_step, self.trainer.step)
            self.trainer.part.step_count = request.run_step
        self.owner, self.checkpoint_every = stream, request.checkpoint_every
        self._set_replicas(request)
        logger.info("Run %r: training blocks %d:%d (accumulation %d, step %d)", self.run_id, self.info.start,
                    self.info.end, request.accumulation, self.trainer.step)
        return self.trainer.step

    def resume_latest(self) -> str | None:
        """After a restart: load the newest checkpoint of our span (any run) so we serve trained weights at once;
        a ``train_open`` of that run continues from it. Returns the run id, or None if there is none."""
        if self.checkpoint_dir is None:
            return None
        span = f"blocks-{self.info.start}-{self.info.end}"
        found = sorted(Path(self.checkpoint_dir).glob(f"*/{span}/state.json"), key=lambda p: p.stat().st_mtime)
        for state_file in reversed(found):
            try:
                optim = OptimConfig.from_dict(read_state_info(state_file.parent)["optim"])
                trainer = StageTrainer(self.blocks, optim, 1, max_pending=MAX_PENDING, auto_step=False)
                trainer.load(state_file.parent)
            except (OSError, KeyError, ValueError) as e:
                logger.warning("Could not resume from %s: %s", state_file.parent, e)
                continue
            self.trainer, self.run_id = trainer, state_file.parent.parent.name
            logger.info("Resumed blocks %d:%d of run %r from %s (step %d)", self.info.start, self.info.end,
                        self.run_id, state_file.parent, trainer.step)
            return self.run_id
        return None

    async def forward(self, request: TrainForward, hidden: torch.Tensor, stream: object) -> torch.Tensor:
        trainer = self._trainer(request.run_id, stream)
        positions = _positions(hidden)
        return await self._compute(trainer.forward, request.micro_id, hidden, positions)

    async def backward(self, request: TrainBackward, tensor: torch.Tensor, stream: object) -> torch.Tensor:
        """The grad of the micro-batch's input; a refused grad drops the micro-batch and applies nothing."""
        trainer = self._trainer(request.run_id, stream)
        if request.recompute:
            if tensor.ndim != 4 or tensor.shape[0] != 2:
                raise GradientError("a recompute backward carries [2, batch, seq, hidden]: the input, then the grad")
            hidden, grad = tensor[0], tensor[1]
            call = (trainer.backward, request.micro_id, grad)
            kwargs = {"hidden": hidden, "position_ids": _positions(hidden)}
        else:
            call, kwargs = (trainer.backward, request.micro_id, tensor), {}
        before = trainer.step
        try:
            grad_input = await self._compute(*call, **kwargs)
        except GradientError as e:
            logger.info("Run %r: dropped micro-batch %r: %s", self.run_id, request.micro_id, e)
            raise
        if trainer.step != before:
            await self._after_step(trainer)
        return grad_input

    async def apply(self, request: TrainApply, stream: object) -> int:
        """Two-phase commit of a step; returns the stage's step count after it."""
        trainer = self._trainer(request.run_id, stream)
        before = trainer.step
        try:
            await self._compute(trainer.apply, request.micro_batches)
        except GradientError as e:
            logger.warning("Run %r: step not applied: %s", self.run_id, e)
            raise
        if trainer.step != before:
            await self._after_step(trainer)
        return trainer.step

    def receive_params(self, request: ParamsPush, flat: torch.Tensor, sender: str) -> None:
        """A replica's parameters for an averaging round of our run."""
        if self.averager is None or request.run_id != self.run_id:
            raise RequestError(f"this peer averages no run {request.run_id!r} (it is in {self.run_id!r})")
        self.averager.receive(sender, request.round, flat, self._numel())

    def current_params(self, request: ParamsFetch) -> torch.Tensor:
        """Our flat parameters, for a replica of our span that joins late."""
        if (request.start, request.end) != (self.info.start, self.info.end):
            raise RequestError(f"this peer serves {self.info.start}:{self.info.end}, not {request.start}:{request.end}")
        return self.current_flat()

    def current_flat(self) -> torch.Tensor:
        with torch.no_grad():
            return parameters_to_vector(list(self.blocks.parameters())).detach().clone()

    def load_params(self, flat: torch.Tensor) -> None:
        """Replace our parameters with a replica's (checked); stale graphs are recomputed."""
        numel = self._numel()
        if flat.ndim != 1 or flat.numel() != numel or not all_finite([flat]):
            raise ValueError(f"a replica sent {list(flat.shape)} values; expected {numel} finite ones")
        with torch.no_grad():
            vector_to_parameters(flat.to(next(self.blocks.parameters()).dtype), list(self.blocks.parameters()))
        if self.trainer is not None:
            self.trainer.version += 1

    def drop(self, request: TrainBackward, stream: object) -> None:
        """Forget a micro-batch whose backward was refused (its gradients are never applied)."""
        if self.trainer is not None and request.run_id == self.run_id and self.owner is stream:
            self.trainer.drop(request.micro_id)

    def stream_closed(self, stream: object) -> None:
        """The owning trainer left: discard its partial step (applied steps and checkpoints stay)."""
        if self.owner is stream and self.trainer is not None:
            if self.trainer.micro_count or self.trainer.pending:
                logger.info("Run %r: trainer left mid-step; discarding %d partial micro-batch(es)", self.run_id,
                            self.trainer.micro_count)
            self.trainer.reset_accumulation()
            self.owner = None

    def save_unsaved(self, why: str = "before leaving") -> Path | None:
        """Checkpoint the run's last applied step unless it is saved already: before the peer leaves, or before it
        switches to another run, so no step it trained is lost (a partial step's gradients are not kept)."""
        if self.trainer is None or self.trainer.step == 0:
            return None
        path = self._checkpoint_path()
        if path is None:
            logger.warning("Run %r: %d trained step(s) of blocks %d:%d are not saved (no --checkpoint_dir); they "
                           "live on only in replicas, if any", self.run_id, self.trainer.step, self.info.start,
                           self.info.end)
            return None
        try:
            if (path / "state.json").is_file() and read_state_info(path).get("step") == self.trainer.step:
                return None
            self.trainer.save(path)
        except (OSError, ValueError) as e:
            logger.error("Run %r: could not save step %d to %s: %s", self.run_id, self.trainer.step, path, e)
            return None
        logger.info("Run %r: step %d saved to %s %s", self.run_id, self.trainer.step, path, why)
        return path

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    # ---- internals --------------------------------------------------------------------------------
    def _trainer(self, run_id: str, stream: object) -> StageTrainer:
        if self.trainer is None or run_id != self.run_id or self.owner is not stream:
            raise RequestError(f"run {run_id!r} is not open on this stream: send train_open first")
        return self.trainer

    async def _compute(self, fn, *args, **kwargs) -> torch.Tensor:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    def _checkpoint_path(self) -> Path | None:
        if self.checkpoint_dir is None:
            return None
        safe_run = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.run_id)[:100] or "run"
        return Path(self.checkpoint_dir) / safe_run / f"blocks-{self.info.start}-{self.info.end}"

    def _set_replicas(self, request: TrainOpen) -> None:
        replicas = [p for p in request.replicas if p != self.info.peer_id]
        self.average_every = request.average_every if replicas else 0
        if not self.average_every:
            self.averager = None
            return
        if self.averager is None or self.averager.replicas != sorted(replicas):
            self.averager = ReplicaAverager(self.info.peer_id, self.run_id, replicas, self.stream_for,
                                            outer_lr=request.outer_lr, outer_momentum=request.outer_momentum,
                                            timeout=self.average_timeout, anchor=self.current_flat())
        logger.info("Run %r: averaging with %d replica(s) every %d step(s)", self.run_id, len(replicas),
                    self.average_every)

    def _numel(self) -> int:
        return sum(p.numel() for p in self.blocks.parameters())

    async def _after_step(self, trainer: StageTrainer) -> None:
        if self.averager is not None and trainer.step % self.average_every == 0:
            flat = parameters_to_vector(list(self.blocks.parameters())).detach()
            self.load_params(await self.averager.average(flat))
        path = self._checkpoint_path()
        if path is not None and self.checkpoint_every and trainer.step % self.checkpoint_every == 0:
            trainer.save(path)
            logger.info("Run %r: step %d checkpointed to %s", self.run_id, trainer.step, path)


def _positions(hidden: torch.Tensor) -> torch.Tensor:
    return torch.arange(hidden.shape[1], device=hidden.device).expand(hidden.shape[0], hidden.shape[1])
