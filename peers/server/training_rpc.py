"""The training side of a peer's stream: open a run, forward and backward micro-batches, step, checkpoint.

A peer trains its whole block span for one run at a time; the stream that opened the run owns it. The
peer owns its blocks' parameters and AdamW state (``peers.training.StageTrainer``) and steps when it has
seen the run's ``accumulation`` backward passes. If the owning stream ends mid-step, the partial gradients
are discarded: no half-applied update. The weights it trains are the ones it serves for inference, so only the
trainers its operator allowed (``peers.core.trainers``, ``--trainers``) may open, run and commit steps.

Replicas of a span never replace newer weights with older ones. A restarted peer keeps its own checkpoint and only
reports a replica that serves another step (it cannot tell that replica's run); when a trainer opens the run, a
replica behind the run's most advanced replica fetches that one's parameters (the trainer names the replicas, most
advanced first, and the step to reach), and a checkpoint never overwrites a newer step of the same run.

A run that names a LoRA ``adapter`` trains only its own adapters on the frozen blocks (``peers.training.lora``):
each such run is a ``TrainingRPC`` of its own (``adapter_mode``) in the peer's ``AdapterRuns``
(``peers.server.adapter_runs``), so several users' adapter runs and a base run share the blocks, each on its own
thread, none changing what the others or any inference session computes. Who may: ``--adapters`` (default anyone);
base training still needs ``--trainers``.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from peers.core.finite import all_finite
from peers.core.trainers import TrainerPolicy
from peers.model.blocks import StageBlocks
from peers.server.averaging import ReplicaAverager, StreamFor, round_at
from peers.server.prompt_runs import PromptRuns
from peers.server.training_chain import MAX_SCALE, TrainChain
from peers.training import GradientError, OptimConfig, StageTrainer
from peers.training.lora import LoraAdapter, parse_adapter
from peers.training.prompts import PromptStageTrainer
from peers.training.state import read_state_info, run_checkpoint_dir, stage_checkpoint_path
from peers.wire.errors import MovedError, RequestError
from peers.wire.messages import (
    ParamsFetch,
    ParamsPush,
    StageInfo,
    TrainApply,
    TrainBackward,
    TrainFetch,
    TrainForward,
    TrainOpen,
    TrainPush,
)
from privacy.peer_ids import short_id
from swarm.links import LinkTable

logger = logging.getLogger(__name__)

MAX_PENDING = 64  # micro-batches forwarded and not yet backwarded, per run
TRAINER_KINDS = (TrainOpen, TrainForward, TrainBackward, TrainApply, TrainFetch)  # what only an allowed trainer sends


def frozen_base(request: TrainOpen) -> bool:
    """A run that leaves the blocks' own weights alone (LoRA adapters; prompt tuning adds its fields here): it opens
    on the adapter side (``AdapterRuns``), allowed by ``--adapters``, never by ``--trainers``."""
    return bool(request.adapter)


def training_refusal(training: TrainingRPC | None, request: object, caller: str, stream: object = None) -> str:
    """Why peer ``caller`` may not make this training request here ('' if it may). Replicas' pushes are checked
    against the run's replicas on arrival; a fetch of the current parameters is open to anyone admitted. Runs that
    change nothing the peer serves (adapters; prompt runs, which are their ``stream``'s own) are allowed by
    ``--adapters``, runs that train the blocks by ``--trainers``."""
    if training is None:
        return TrainerPolicy().refusal(caller)
    runs = training.adapter_runs
    run_id = getattr(request, "run_id", "")
    prompt_run = (isinstance(request, TrainOpen) and request.prompts > 0 and not request.adapter) or (
        stream is not None and training.prompt_runs.get(run_id, stream) is not None)
    if prompt_run and runs is not None:
        return runs.refusal(request, caller)
    if runs is not None and ((isinstance(request, TrainOpen) and frozen_base(request))
                             or runs.get(getattr(request, "run_id", "")) is not None):
        return runs.refusal(request, caller)  # an adapter run: --adapters, and only its own trainer
    if isinstance(request, TRAINER_KINDS):
        return training.trainers.refusal(caller)
    return ""


async def fetch_params(stream_for: StreamFor, peer_id: str, start: int, end: int, timeout: float
                       ) -> tuple[int, torch.Tensor]:
    """Blocks ``[start, end)`` as peer ``peer_id`` serves them now (any part of its span): its step and flat
    parameters (``ParamsFetch``), over our encrypted stream to it."""
    stream = await stream_for(peer_id)
    reply, flat = await stream.call(ParamsFetch(start=start, end=end), None, timeout)
    return reply.step, flat


class TrainingRPC:
    """Serves training requests for one peer's blocks (``blocks`` is the backend's ``StageBlocks``)."""

    def __init__(self, blocks: StageBlocks, info: StageInfo, *, trainers: TrainerPolicy,
                 checkpoint_dir: Path | None = None, stream_for: StreamFor | None = None,
                 average_timeout: float = 30.0, chain_timeout: float = 60.0, links: LinkTable | None = None,
                 adapter_mode: bool = False) -> None:
        self.blocks, self.info, self.checkpoint_dir, self.trainers = blocks, info, checkpoint_dir, trainers
        self.stream_for, self.average_timeout = stream_for, average_timeout  # streams to other peers (averaging)
        self.averager: ReplicaAverager | None = None
        self.average_every = 0
        self.trainer: StageTrainer | None = None
        self.run_id = ""
        self.owner: object | None = None  # the stream that opened the run
        self.checkpoint_every = 0
        self.fetched_step = 0  # with no run open: the step of the replica whose parameters we loaded at start
        # after a move (``peers.server.stage_server``): the refusal for the runs of the span we left, and the step of
        # the trained weights we carried over or fetched (a run opened here without its checkpoint counts from it)
        self.moved = ""
        self.carried_step = 0
        self.retired = False  # the peer moved off our span (``retire``)
        self._opening = asyncio.Lock()
        # pushes from/to the adjacent stages; ``links``: our measured links (adaptive compression)
        self.chain = TrainChain(self, stream_for, timeout=chain_timeout, links=links)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-train")
        self.adapter_mode = adapter_mode  # this object serves one adapter run (``peers.server.adapter_runs``)
        self.adapter_owner = ""  # its trainer's peer id
        self.adapter_runs: Any = None  # the base side's registry of adapter runs (``AdapterRuns``), set by the server
        self.prompt_runs = PromptRuns(blocks, max_pending=MAX_PENDING)  # frozen runs, side by side with ours

    @property
    def step(self) -> int:
        """The step of the weights we serve: our run's, else that of the replica we started from."""
        return self.fetched_step if self.trainer is None else self.trainer.step

    def step_of(self, run_id: str, stream: object) -> int:
        """The step of run ``run_id`` of ``stream``: a prompt run's own count, else that of our weights."""
        prompt_run = self.prompt_runs.get(run_id, stream)
        return self.step if prompt_run is None else prompt_run.step

    async def open(self, request: TrainOpen, stream: object) -> int:
        """Join ``request.run_id`` (resuming from this peer's checkpoint if it has one); returns the step.

        A replica behind ``request.run_step`` catches up: it loads the parameters of the first replica listed that
        is ahead of it (``_catch_up``) and counts from the run's step.
        """
        async with self._opening:  # a catch-up awaits the network: opens of other streams wait for this one
            return await self._open(request, stream)

    async def _open(self, request: TrainOpen, stream: object) -> int:
        if self.retired:  # this peer moved off our span: no run opens here again
            raise MovedError(self.moved)
        if (request.start, request.end) != (self.info.start, self.info.end):
            if self.moved:
                raise MovedError(self.moved)
            raise RequestError(f"training uses a peer's whole span: this peer serves {self.info.start}:"
                               f"{self.info.end}, not {request.start}:{request.end}")
        if request.prompts:  # prompt tuning: a frozen run beside the others (``peers.server.prompt_runs``)
            return self.prompt_runs.open(request, stream)
        self.prompt_runs.discard(request.run_id, stream)  # (the trainer re-opens it as a run that trains our blocks)
        if self.owner is not None and self.owner is not stream and self.run_id != request.run_id:
            raise RequestError(f"this peer is training run {self.run_id!r} for another trainer; pick another peer")
        if not 1 <= request.accumulation <= 1 << 16 or min(request.checkpoint_every, request.run_step,
                                                            request.average_every) < 0:
            raise RequestError("accumulation must be in 1..65536, checkpoint_every, run_step and average_every >= 0")
        if request.staleness not in (0, 1):
            raise RequestError(f"staleness must be 0 (synchronous steps) or 1 (asynchronous), got {request.staleness}")
        if request.average_every and request.replicas and self.stream_for is None:
            raise RequestError("this peer cannot reach other peers to average with its replicas")
        self.chain.check_open(request)
        self._check_adapter(request)
        try:
            optim = OptimConfig.from_dict(request.optim)
        except (TypeError, ValueError) as e:
            raise RequestError(f"bad optimizer config: {e}") from None
        if self.trainer is None or self.run_id != request.run_id:
            await self._compute(self._switch, request, optim)  # disk I/O off the event loop (heartbeats go on)
        else:
            self.trainer.reset_accumulation()  # a re-opened run starts its step afresh
            self.trainer.accumulation, self.trainer.auto_step = request.accumulation, not request.explicit_apply
            self.trainer.keep_activations = request.keep_activations
        self.trainer.staleness = request.staleness
        caught_up = False
        others = [p for p in request.replicas if p != self.info.peer_id]
        if request.run_step > self.trainer.step and others:
            # a replica joining (or rejoining) a run under way takes the parameters of a replica ahead of it and
            # counts from the run's step, so its lr schedule and averaging rounds match the others'. If none ahead
            # answers, it keeps its own weights and the next averaging round brings them in line. A lone stage
            # keeps its count: a trainer/stage mismatch shows.
            caught_up = await self._catch_up(request, others)
            logger.info("Run %r: joined at step %d (from %d) to match the other replicas; AdamW state kept as is",
                        self.run_id, request.run_step, self.trainer.step)
            self.trainer.part.step_count = request.run_step
        self.owner, self.checkpoint_every = stream, request.checkpoint_every
        self.chain.opened(request)  # pending chained waits of an earlier attempt fail now
        self._set_replicas(request, fresh=caught_up)
        logger.info("Run %r: training blocks %d:%d (accumulation %d, step %d)", self.run_id, self.info.start,
                    self.info.end, request.accumulation, self.trainer.step)
        return self.trainer.step

    def _check_adapter(self, request: TrainOpen) -> None:
        """An adapter run opens only on an adapter-mode side, with the spec it was made with, and no replicas."""
        if frozen_base(request) != self.adapter_mode:
            raise RequestError(f"run {request.run_id[:64]!r} trains adapters here: open it with its adapter spec"
                               if self.adapter_mode else "an adapter run is opened on the adapter side")
        if not self.adapter_mode:
            return
        try:
            spec = parse_adapter(request.adapter)
        except ValueError as e:
            raise RequestError(str(e)) from None
        if self.trainer is not None and self.trainer.adapter is not None and self.trainer.adapter.spec != spec:
            raise RequestError(f"run {request.run_id[:64]!r} trains the adapter {self.trainer.adapter.spec.text()} "
                               f"here, not {request.adapter[:100]}: use another run id for another adapter")
        if [p for p in request.replicas if p != self.info.peer_id] or request.average_every:
            raise RequestError("an adapter run takes one peer per span: averaging replicas' adapters is not "
                               "supported yet")

    def _switch(self, request: TrainOpen, optim: OptimConfig) -> None:
        """Save the run we leave, then start ``request.run_id`` from our checkpoint of it if we have one."""
        self.save_unsaved(f"before switching to run {request.run_id!r}")
        spec = parse_adapter(request.adapter)
        try:
            adapter = LoraAdapter(self.blocks, spec, request.adapter_seed) if spec is not None else None
        except ValueError as e:
            raise RequestError(str(e)) from None
        self.trainer = StageTrainer(self.blocks, optim, request.accumulation, keep_activations=request.keep_activations,
                                    max_pending=MAX_PENDING, auto_step=not request.explicit_apply, adapter=adapter,
                                    frozen_base=self.adapter_mode)
        self.trainer.owner = self.adapter_owner
        self.run_id = request.run_id
        path = self._checkpoint_path()
        if self.adapter_mode and path is not None and (path / "state.json").is_file() and \
                read_state_info(path).get("owner") != self.adapter_owner:
            self.trainer = None
            raise RequestError(f"run {request.run_id[:64]!r}: the adapters saved on this peer belong to another "
                               "trainer: pick another run id")
        if path is not None and (path / "state.json").is_file():
            self.trainer.load(path)
            logger.info("Run %r: resumed blocks %d:%d from %s at step %d", self.run_id, self.info.start,
                        self.info.end, path, self.trainer.step)
        elif self.carried_step:  # we moved here with trained weights: the run goes on from their step
            self.trainer.part.step_count = self.carried_step
            logger.info("Run %r: blocks %d:%d carry the weights of step %d (moved here; AdamW state starts fresh)",
                        self.run_id, self.info.start, self.info.end, self.carried_step)

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

    async def start_from_replicas(self, peer_ids: list[str], timeout: float) -> None:
        """At start: a peer with no checkpoint of its span takes the parameters a replica serves now (it may have
        trained). One that resumed its own checkpoint keeps it: a replica's run is unknown here, so it only says
        when a replica serves another step (behind: never loaded; ahead: the trainer's next open catches us up)."""
        for peer_id in peer_ids:
            try:
                step, flat = await self._fetch(peer_id, timeout)
                if self.trainer is None:
                    self.load_params(flat)
            except Exception as e:
                logger.warning("Could not fetch parameters from replica %s: %s", short_id(peer_id), e)
                continue
            span = f"{self.info.start}:{self.info.end}"
            if self.trainer is None:
                self.fetched_step = step
                logger.info("Fetched the current parameters of blocks %s from replica %s (its step %d)", span,
                            short_id(peer_id), step)
            elif step < self.trainer.step:
                logger.warning("Blocks %s: kept our checkpoint of run %r at step %d; replica %s serves step %d, "
                               "older, so its parameters were not loaded", span, self.run_id, self.trainer.step,
                               short_id(peer_id), step)
            elif step > self.trainer.step:
                logger.warning("Blocks %s: kept our checkpoint of run %r at step %d; replica %s serves step %d "
                               "(ahead in this run, or another run): not loaded now; when a trainer opens the run, "
                               "the replica behind catches up", span, self.run_id, self.trainer.step, short_id(peer_id),
                               step)
            return

    async def forward(self, request: TrainForward, hidden: torch.Tensor, stream: object) -> torch.Tensor:
        trainer = self._trainer(request.run_id, stream)
        if isinstance(trainer, PromptStageTrainer):  # its deep prompts come packed after the hidden states
            return await self._compute(trainer.forward_packed, request.micro_id, hidden, request.prompt_shape)
        if request.prompt_shape:
            raise RequestError(f"run {request.run_id[:64]!r} has no prompts: a forward carries no deep prompts")
        positions = _positions(hidden)
        return await self._compute(trainer.forward, request.micro_id, hidden, positions, at_step=request.at_step)

    async def backward(self, request: TrainBackward, tensor: torch.Tensor, stream: object) -> torch.Tensor:
        """The grad of the micro-batch's input; a refused grad drops the micro-batch and applies nothing. A
        ``scale`` other than 1 multiplies the grad we get and divides the one we return (a replica's share)."""
        trainer = self._trainer(request.run_id, stream)
        if not 0 < request.scale <= MAX_SCALE:  # NaN fails too
            raise GradientError(f"scale must be in (0, {MAX_SCALE:.0f}], got {request.scale}")
        if request.recompute:
            if tensor.ndim != 4 or tensor.shape[0] != 2:
                raise GradientError("a recompute backward carries [2, batch, seq, hidden]: the input, then the grad")
            hidden, grad = tensor[0], tensor[1]
            kwargs = {"hidden": hidden, "position_ids": _positions(hidden)}
        else:
            grad, kwargs = tensor, {}
        call = (trainer.backward, request.micro_id, grad * request.scale if request.scale != 1 else grad)
        before = trainer.step
        try:
            grad_input = await self._compute(*call, **kwargs)
        except GradientError as e:
            logger.info("Run %r: dropped micro-batch %r: %s", self.run_id, request.micro_id, e)
            raise
        if trainer.step != before and not isinstance(trainer, PromptStageTrainer):
            await self._after_step(trainer)
        return grad_input / request.scale if request.scale != 1 else grad_input

    async def apply(self, request: TrainApply, stream: object) -> int:
        """Two-phase commit of a step; returns the stage's step count after it."""
        trainer = self._trainer(request.run_id, stream)
        before = trainer.step
        try:
            await self._compute(trainer.apply, request.micro_batches)
        except GradientError as e:
            logger.warning("Run %r: step not applied: %s", self.run_id, e)
            raise
        if trainer.step != before and not isinstance(trainer, PromptStageTrainer):
            self.chain.applied(trainer.pending_ids())
            await self._after_step(trainer)
        return trainer.step

    def check_chained(self, request: TrainForward | TrainBackward, stream: object) -> None:
        """Refuse a chained request at once if its run is not open here or its route names strangers."""
        self._trainer(request.run_id, stream)
        self.chain.check_route(request)

    def receive_push(self, request: TrainPush, tensor: torch.Tensor, sender: str,
                     indices: torch.Tensor | None = None) -> None:
        """An adjacent stage's push for our run (``peers.server.training_chain``)."""
        if self.trainer is None or self.owner is None or request.run_id != self.run_id:
            if self.moved:
                raise MovedError(self.moved)
            raise RequestError(f"push refused: run {request.run_id[:64]!r} is not open on this peer")
        self.chain.receive(request, tensor, sender, indices)

    def kept(self, request: TrainFetch, stream: object) -> torch.Tensor:
        """Chain replay: a tensor this stage exchanged with a neighbour in the last step it applied."""
        self._trainer(request.run_id, stream)
        return self.chain.kept(request.micro_id, request.what)

    def receive_params(self, request: ParamsPush, flat: torch.Tensor, sender: str) -> None:
        """A replica's parameters for an averaging round of our run."""
        if self.averager is None or request.run_id != self.run_id:
            raise RequestError(f"this peer averages no run {request.run_id!r} (it is in {self.run_id!r})")
        self.averager.receive(sender, request.round, flat, self._numel(), request.anchor)

    def current_params(self, request: ParamsFetch) -> torch.Tensor:
        """Our flat parameters of blocks ``[request.start, request.end)``, any part of our span: for a replica of our
        span that joins late, or a peer that moves onto some of our blocks."""
        if not self.info.start <= request.start < request.end <= self.info.end:
            if self.moved:
                raise MovedError(self.moved)
            raise RequestError(f"this peer serves {self.info.start}:{self.info.end}, not {request.start}:{request.end}")
        if request.run_id and request.run_id != self.run_id:
            held = f"run {self.run_id!r}'s" if self.run_id else "no training run's"
            raise RequestError(f"blocks {self.info.start}:{self.info.end} here hold {held} weights, not run "
                               f"{request.run_id[:64]!r}'s")
        return self.current_flat(request.start, request.end)

    def current_flat(self, start: int | None = None, end: int | None = None) -> torch.Tensor:
        """The flat parameters of blocks ``[start, end)`` (default: all of ours)."""
        with torch.no_grad():
            return parameters_to_vector(self._params(start, end)).detach().clone()

    def load_range(self, start: int, end: int, flat: torch.Tensor) -> None:
        """Replace the parameters of our blocks ``[start, end)`` with ``flat`` (checked: size, finite)."""
        params = self._params(start, end)
        numel = sum(p.numel() for p in params)
        if flat.ndim != 1 or flat.numel() != numel or not all_finite([flat]):
            raise ValueError(f"a peer sent {list(flat.shape)} values for blocks {start}:{end}; expected {numel} "
                             f"finite ones")
        with torch.no_grad():
            vector_to_parameters(flat.to(params[0].dtype), params)

    async def retire(self, refusal: str) -> None:
        """This peer moves off our span: checkpoint the run's last applied step (after the computation under way),
        drop the run (its trainer's next request gets ``refusal``, a ``moved:`` one) and stop the training thread."""
        self.moved, self.retired = refusal, True
        self.chain.reset(refusal)  # chained waits of the run fail now
        if self.adapter_runs is not None:
            await self.adapter_runs.retire(refusal)
        await self._compute(self.save_unsaved, "before moving to another span")
        self.trainer, self.owner, self.averager = None, None, None
        self.prompt_runs.clear()
        self.shutdown()

    def _params(self, start: int | None, end: int | None) -> list[torch.nn.Parameter]:
        if self.adapter_mode:  # an adapter run's parameters are its adapter's, whole
            if (start, end) not in ((None, None), (self.info.start, self.info.end)):
                raise RequestError(f"an adapter run's parameters come for its whole span {self.info.start}:"
                                   f"{self.info.end}")
            return self.trainer.part.params if self.trainer is not None else []
        first = 0 if start is None else start - self.info.start
        last = len(self.blocks) if end is None else end - self.info.start
        return [p for block in list(self.blocks)[first:last] for p in block.parameters()]

    def load_params(self, flat: torch.Tensor) -> None:
        """Replace our parameters with a replica's (checked); stale graphs are recomputed."""
        numel = self._numel()
        if flat.ndim != 1 or flat.numel() != numel or not all_finite([flat]):
            raise ValueError(f"a replica sent {list(flat.shape)} values; expected {numel} finite ones")
        with torch.no_grad():
            vector_to_parameters(flat.to(next(self.blocks.parameters()).dtype), list(self.blocks.parameters()))
        if self.trainer is not None:
            self.trainer.weights_replaced()

    def drop(self, request: TrainBackward, stream: object) -> None:
        """Forget a micro-batch whose backward was refused (its gradients are never applied)."""
        if prompt_run := self.prompt_runs.get(request.run_id, stream):
            prompt_run.drop(request.micro_id)
        elif self.trainer is not None and request.run_id == self.run_id and self.owner is stream:
            self.trainer.drop(request.micro_id)

    def stream_closed(self, stream: object) -> None:
        """The owning trainer left: discard its partial step (applied steps and checkpoints stay)."""
        self.prompt_runs.closed(stream)
        if self.owner is stream and self.trainer is not None:
            if self.trainer.micro_count or self.trainer.pending:
                logger.info("Run %r: trainer left mid-step; discarding %d partial micro-batch(es)", self.run_id,
                            self.trainer.micro_count)
            self.trainer.reset_accumulation()
            self.owner = None
            self.chain.reset("the trainer's stream closed")
        if self.adapter_runs is not None:
            self.adapter_runs.stream_closed(stream)

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
            if self._saved_step(path) == self.trainer.step or not self._save(self.trainer, path):
                return None
        except (OSError, ValueError) as e:
            logger.error("Run %r: could not save step %d to %s: %s", self.run_id, self.trainer.step, path, e)
            return None
        logger.info("Run %r: step %d saved to %s %s", self.run_id, self.trainer.step, path, why)
        return path

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self.adapter_runs is not None:
            self.adapter_runs.shutdown()

    # ---- internals --------------------------------------------------------------------------------
    def _trainer(self, run_id: str, stream: object) -> StageTrainer:
        if prompt_run := self.prompt_runs.get(run_id, stream):
            return prompt_run
        if self.trainer is None or run_id != self.run_id or self.owner is not stream:
            if self.moved:  # the run was open on the span this peer left: its trainer chooses the stages again
                raise MovedError(self.moved)
            raise RequestError(f"run {run_id!r} is not open on this stream: send train_open first")
        return self.trainer

    async def _compute(self, fn, *args, **kwargs) -> Any:
        """``fn`` on the training thread: one computation (or checkpoint) at a time, off the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    def _checkpoint_path(self) -> Path | None:
        if self.checkpoint_dir is None:
            return None
        if self.adapter_mode:
            return adapter_checkpoint_path(self.checkpoint_dir, self.run_id, self.info.start, self.info.end)
        return stage_checkpoint_path(self.checkpoint_dir, self.run_id, self.info.start, self.info.end)

    async def _fetch(self, peer_id: str, timeout: float) -> tuple[int, torch.Tensor]:
        """A replica's step and current flat parameters (``ParamsFetch``)."""
        return await fetch_params(self.stream_for, peer_id, self.info.start, self.info.end, timeout)

    async def _catch_up(self, request: TrainOpen, others: list[str]) -> bool:
        """Load the parameters of the first replica listed (the trainer lists the most advanced first) that is
        ahead of our step in this run; never older ones. True if we loaded some."""
        own = self.trainer.step
        for peer_id in others:
            try:
                step, flat = await self._fetch(peer_id, self.average_timeout)
                if step > own:
                    self.load_params(flat)
            except Exception as e:
                logger.warning("Run %r: could not fetch parameters from replica %s: %s", self.run_id, short_id(peer_id),
                               e)
                continue
            if step > own:
                logger.info("Run %r: caught up from replica %s: loaded its parameters of step %d (ours were at "
                            "step %d)", self.run_id, short_id(peer_id), step, own)
                return True
        logger.warning("Run %r: no replica ahead of our step %d answered; keeping our weights and counting from "
                       "the run's step %d (the next averaging round brings them in line)", self.run_id, own,
                       request.run_step)
        return False

    def _saved_step(self, path: Path) -> int | None:
        return read_state_info(path).get("step") if (path / "state.json").is_file() else None

    def _save(self, trainer: StageTrainer, path: Path) -> bool:
        """Checkpoint ``trainer`` to ``path`` unless that holds a newer step of this run (then warn, keep it)."""
        saved = self._saved_step(path)
        if saved is not None and saved > trainer.step:
            logger.warning("Run %r: step %d of blocks %d:%d not saved: %s holds step %d of this run, newer, and is "
                           "kept (these blocks are behind their own checkpoint)", self.run_id, trainer.step,
                           self.info.start, self.info.end, path, saved)
            return False
        trainer.save(path)
        return True

    def _set_replicas(self, request: TrainOpen, fresh: bool = False) -> None:
        """Average with the run's other replicas (a new averager when they change, or ``fresh`` weights came)."""
        replicas = [p for p in request.replicas if p != self.info.peer_id]
        self.average_every = request.average_every if replicas else 0
        if not self.average_every:
            self.averager = None
            return
        if fresh or self.averager is None or self.averager.replicas != sorted(replicas) or \
                not self.averager.compression.matches(request.compression):
            # rounds are named by steps (``round_at``): a new averager's first round is the one after our step,
            # the same as the other replicas' (they count steps from the run's too)
            self.averager = ReplicaAverager(self.info.peer_id, self.run_id, replicas, self.stream_for,
                                            outer_lr=request.outer_lr, outer_momentum=request.outer_momentum,
                                            timeout=self.average_timeout, anchor=self.current_flat(),
                                            first_round=round_at(self.trainer.step, self.average_every) + 1,
                                            compression=request.compression, links=self.chain.links)
        logger.info("Run %r: averaging with %d replica(s) every %d step(s)", self.run_id, len(replicas),
                    self.average_every)

    def _numel(self) -> int:
        return sum(p.numel() for p in self.blocks.parameters())

    async def _after_step(self, trainer: StageTrainer) -> None:
        if self.averager is not None and trainer.step % self.average_every == 0:
            flat = parameters_to_vector(list(self.blocks.parameters())).detach()
            self.load_params(await self.averager.average(flat, round_at(trainer.step, self.average_every)))
        path = self._checkpoint_path()
        if path is not None and self.checkpoint_every and trainer.step % self.checkpoint_every == 0 and \
                await self._compute(self._save, trainer, path):
            logger.info("Run %r: step %d checkpointed to %s", self.run_id, trainer.step, path)


def adapter_checkpoint_path(checkpoint_dir: str | Path, run_id: str, start: int, end: int) -> Path:
    """``checkpoint_dir/<run id>/adapter-START-END``: a peer's share of an adapter run (adapter + AdamW state)."""
    return run_checkpoint_dir(checkpoint_dir, run_id) / f"adapter-{start}-{end}"


def _positions(hidden: torch.Tensor) -> torch.Tensor:
    return torch.arange(hidden.shape[1], device=hidden.device).expand(hidden.shape[0], hidden.shape[1])
