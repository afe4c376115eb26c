"""``SwarmTrainer``: train a model whose blocks live on the swarm, by remote autodiff through its stages.

The trainer owns the embedding and the head (and their AdamW); each stage peer owns its blocks and
theirs (``peers.server.training_rpc``). A micro-batch goes: embedding here -> ``train_forward`` through each stage
-> head and loss here -> ``train_backward`` through the stages in reverse -> embedding grads here. With
``topology="chain"`` (the default) each stage hands its output (its input's grad) straight to the next (previous)
stage and the trainer's link carries only the first stage's input and the last stage's output
(``peers.trainer.chain``); with ``"star"`` every tensor travels on the trainer's encrypted stream to each peer. Up
to ``in_flight`` micro-batches are under way at once, so the stages work concurrently (a stage runs its stream's
requests in order).

A step is two-phase: the micro-batches only accumulate gradients on the stages; once all of them are back,
``train_apply`` tells every stage to apply its share, and a stage refuses if it holds fewer micro-batches
than the trainer sent it. So a stage peer that dies mid-step costs a retry of that step on re-chosen stages
(re-opening the run discards partial gradients everywhere), and a trainer that vanishes applies nothing. A stage
that dies between its last backward and the commit, after the others applied the step, gets the step replayed
when it is back (``peers.trainer.replay``); while a span has no peer, the trainer waits for one (``pipeline_wait``
seconds, saying so every few seconds), and a banned peer that answers again is taken back at once.

Stages with several replicas (peers serving the same span) split each step's micro-batches in proportion to
their speed; each replica takes a full AdamW step on its share, and every ``average_every`` steps the
replicas average their parameters (``peers.server.averaging``, DiLoCo-style). Opening a run takes two rounds: every
replica reports its step in the run, then one behind its span's most advanced replica is re-opened with that
step and catches up from it (weights and step count), so newer weights are never replaced by older ones.

Weight staleness is zero by default: a step's micro-batches all see the same weights, because stages apply updates
only on ``train_apply`` and the next step starts after it. The price is a pipeline fill and drain per step
(with S stages and M micro-batches the bubble is about (S-1)/(M+S-1)); more micro-batches per step shrink it.
With ``staleness=1`` (asynchronous steps, ``peers.trainer.step_run``) ``train_step(batches, upcoming)`` starts the
next step's forwards while this one drains and commits; each step's gradients are taken at the weights from before
the previous step's update (w[n+1] = w[n] - lr * g(w[n-1])), the same whether or not the steps overlapped, so a
one-process reference with that schedule gives the same losses. A failure, or any re-opening of the run, drops the
step started ahead and finishes the step synchronously (at the current weights), then the overlap resumes.
Between averaging rounds, replicas of a stage drift apart (by design, as in DiLoCo); that is not staleness.

Peers join and leave mid-run: one that dies costs a retry of the step (above); one that starts serving a span
of the pipeline is found within ``rechoose_every`` seconds and joins as another replica of that span at the
next step (the pipeline's tiling itself changes only after a failure).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from hivemind.p2p import P2PDaemonError, P2PHandlerError

from peers.client.retry import backoff, classify, report_failure
from peers.client.swarm_client import SwarmClient
from peers.core.config import TOPOLOGIES
from peers.model.local import default_position_ids
from peers.trainer import chain
from peers.trainer.pipeline import stage_groups
from peers.trainer.prompt_batch import prompt_micro_batch, prompted_logits, setup_prompts
from peers.trainer.replay import StageShare, StepRecord, recover
from peers.trainer.run_plan import RunPlanner
from peers.trainer.step_run import StepRun
from peers.training import OptimConfig, PartOptimizer, loss_of, unique_parameters
from peers.training.lora import parse_adapter
from peers.training.versions import WeightVersions, check_stale_micro_batches
from peers.wire.errors import ChainError, MovedError, RequestError
from peers.wire.messages import TrainApply, TrainBackward, TrainForward, TrainOpen
from privacy.errors import MembershipError
from privacy.peer_ids import short_id
from swarm.compression.policy import check_setting
from swarm.compression.sender import RunCompression
from swarm.records import PeerRecord
from swarm.stages import spread

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    loss: float  # mean loss over the step's micro-batches
    tokens: int  # tokens the step trained on
    stage_steps: list[int]  # each stage's optimizer steps after it
    seconds: float  # wall time of the step
    stage_busy: list[float]  # seconds each stage spent computing for this step
    stage_peers: list[str]  # peer id of each stage

    @property
    def utilisation(self) -> list[float]:
        """Fraction of the step's wall time each stage spent computing."""
        return [busy / self.seconds if self.seconds > 0 else 0.0 for busy in self.stage_busy]


class StageFailure(ConnectionError):
    """A stage peer broke its stream or timed out, or refused because it moved to another span (``moved``: no
    ban); the step is retried on re-chosen stages."""

    def __init__(self, peer_id: str, error: BaseException, started: float | None = None) -> None:
        super().__init__(f"stage peer {short_id(peer_id)} failed: {error!r}")
        self.peer_id, self.error = peer_id, error
        self.started = started  # time.monotonic() when the failed request was sent


class SwarmTrainer:
    """One training run over the swarm that ``client`` is connected to."""

    def __init__(self, client: SwarmClient, optim: OptimConfig, accumulation: int, *, in_flight: int = 4,
                 run_id: str | None = None, keep_activations: bool = True, recompute: bool = False,
                 checkpoint_every: int = 0, average_every: int = 0, outer_lr: float = 1.0,
                 outer_momentum: float = 0.0, rechoose_every: float = 30.0, pipeline_wait: float = 60.0,
                 topology: str = "chain", plan: bool = False, compression: str = "none",
                 stage_compression: dict[int, str] | None = None, staleness: int = 0,
                 stale_micro_batches: int | None = 1, adapter: str = "",
                 adapter_seed: int = 0, prompts: int = 0, deep_prompts: bool = False, prompt_seed: int = 0) -> None:
        if accumulation < 1 or in_flight < 1:
            raise ValueError("accumulation and in_flight must be >= 1")
        if staleness not in (0, 1):
            raise ValueError(f"staleness must be 0 (synchronous steps) or 1 (asynchronous), got {staleness}")
        check_stale_micro_batches(stale_micro_batches)
        if staleness and recompute:
            raise ValueError("staleness 1 needs stages that keep each micro-batch's input (recompute=False)")
        # how the run's tensors travel (``swarm.compression``): the trainer's own sends, and each stage's unless
        # ``stage_compression`` names another setting for stage k (what that stage sends: e.g. behind a slow uplink)
        self.compression = RunCompression(compression, client.router.links)
        self.stage_compression = {k: check_setting(text) for k, text in (stage_compression or {}).items()}
        if topology == "star" and {compression, *self.stage_compression.values()} != {"none"}:
            raise ValueError("compression works in the chain topology only (the star path sends tensors as they are)")
        if topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {list(TOPOLOGIES)}, got {topology!r}")
        self.topology = topology  # "chain": stages hand tensors to each other; "star": all through the trainer
        self.attempt = 0  # tries of steps so far: chain micro-batch ids carry it (a retry never meets old pushes)
        if client.local_blocks is not None:
            raise ValueError("training with local_blocks is not supported yet; use local_blocks=0")
        self.client, self.optim, self.accumulation, self.in_flight = client, optim, accumulation, in_flight
        self.run_id = run_id or secrets.token_hex(8)
        self.keep_activations = keep_activations and not recompute
        self.recompute = recompute  # stateless stages: the input travels again with each backward
        self.checkpoint_every = checkpoint_every
        self.average_every = average_every  # replicas of a stage average their parameters every H local steps
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum  # DiLoCo outer Nesterov SGD (1, 0: mean)
        self.rechoose_every = rechoose_every  # seconds between looks for replicas that joined (0: never)
        self.pipeline_wait = pipeline_wait  # seconds to wait for a span's peer to come back (e.g. a restart)
        self.broken_since = 0.0  # time.monotonic() when a stage last failed, until a step commits everywhere again
        self._span_steps: dict[tuple[int, int], int] = {}  # the step each span must be at (its replicas' best)
        self._unapplied: dict[tuple[int, int], StageShare] = {}  # a span's last step, that no peer of it applied
        self._record: StepRecord | None = None  # the step being run: each stage's inputs, outputs, gradients
        self.replayed = 0  # steps replayed on a stage that missed their commit
        self.lost_steps: list[dict] = []  # spans that came back behind the run (steps that could not be replayed)
        self._chosen_at = 0.0
        self._considered: set[str] = set()  # peers the last choice saw (used or left out)
        self.run_step = 0  # the run's optimizer steps: the most any stage reported
        self.replicas: list[list[PeerRecord]] = []  # per stage: the peers serving its span in this run
        self.assignment: list[list[int]] = []  # per stage: which replica takes micro-batch i of a step
        self.shares: list[list[int]] = []  # per stage: micro-batches per step of each replica
        # a LoRA run (``peers.training.lora``) trains only the adapters the stages hold for it, made from
        # ``adapter_seed``: the embedding and head stay frozen here as the blocks do there
        self.adapter, self.adapter_seed = (spec.text() if (spec := parse_adapter(adapter)) else ""), adapter_seed
        if self.adapter and prompts:
            raise ValueError("a run trains LoRA adapters or prompts, not both: drop `adapter` or `prompts`")
        if not self.adapter:
            for module in (client.embedding, client.head):
                module.requires_grad_(True).train()
        self.part = PartOptimizer(unique_parameters(client.embedding, client.head) if not self.adapter else [], optim)
        self.stages: list[PeerRecord] = []
        self.steps_done = 0
        self.bytes_sent = 0  # hidden-state bytes the trainer sent to stages (before encryption overhead)
        # plan=True: this trainer is the broker of its run: it plans it, publishes the plan, waits for the peers to
        # move and trains on the plan's group nearest it (peers.trainer.run_plan); else the tiling of swarm.stages
        self.planner = RunPlanner(self) if plan else None
        # staleness 1: a step's gradients are taken at the weights before the previous step (``StepRun``)
        self.staleness = staleness
        self.stale_micro_batches = stale_micro_batches  # of each step's: on the old weights (None: all)
        self.versions = WeightVersions(self.part.params)  # the trainer part's kept weights (staleness 1)
        self._ahead: StepRun | None = None  # the next step, started while the last one drained (staleness 1)
        self._gate: asyncio.Semaphore | None = None  # micro-batches in flight, over both steps
        self._opened = 0  # times the run was (re-)opened: a step started before a re-open is dropped
        self._clean = False  # the last step was applied everywhere since the run was opened: the next may be stale
        self._peer_steps: dict[str, int] = {}  # each stage peer's step count (the weights ``at_step`` names)
        # prompt tuning (``peers.trainer.prompt_batch``): the part is the prompts; the model stays frozen everywhere
        self.prompts = setup_prompts(self, prompts, deep_prompts, prompt_seed)
        self._evals = 0  # held-out forwards of a prompt run

    # ---- synchronous API -------------------------------------------------------------------------
    def start(self, wait: float | None = None) -> list[PeerRecord]:
        """Choose the pipeline (peers whose spans tile the blocks, waiting up to ``wait`` s for them, default
        ``pipeline_wait``) and open the run on every stage; ``NoPipelineError`` if there is none by then."""
        return self.client.loop.run(self.start_async(wait))

    def settle(self) -> None:
        """Replay a step that a stage has not applied yet (its peer is restarting), waiting up to
        ``pipeline_wait`` for it; call before the end of a run. Nothing to do when every stage is in step."""
        if self._unapplied:
            self.stages = []
            self.client.loop.run(self.start_async())

    def train_step(self, micro_batches: Sequence[torch.Tensor], upcoming: Sequence[torch.Tensor] | None = None
                   ) -> StepResult:
        """One optimizer step over ``accumulation`` micro-batches of token ids ``[b, T + 1]``. With staleness 1,
        ``upcoming`` (the next step's micro-batches, passed as the next call's ``micro_batches``) start while this
        step drains."""
        return self.client.loop.run(self.train_step_async(micro_batches, upcoming))

    @property
    def ahead_batches(self) -> int:
        """Micro-batches of the next step already handed over (``upcoming``): not trained on yet."""
        return len(self._ahead.batches) if self._ahead is not None else 0

    def evaluate(self, input_ids: torch.Tensor) -> float:
        """Mean next-token loss on ``input_ids`` through the swarm (plain forward, no training state)."""
        with torch.no_grad():
            if self.prompts is not None:  # with the prompts, through the run's stages
                return loss_of(self.client.loop.run(prompted_logits(self, input_ids)), input_ids).item()
            return loss_of(self.client.forward(input_ids), input_ids).item()

    # ---- async -------------------------------------------------------------------------------------
    async def start_async(self, wait: float | None = None, groups: list[list[PeerRecord]] | None = None
                          ) -> list[PeerRecord]:
        groups = groups or await self._stage_groups(self.pipeline_wait if wait is None else wait)
        if self.adapter:  # an adapter run lives on one peer per span (its adapters are not averaged between replicas)
            groups = [group[:1] for group in groups]
        self._chosen_at, self._considered = time.monotonic(), {r.peer_id for group in groups for r in group}
        run_step = max(self.run_step, self.steps_done)
        self.replicas, self.assignment, self.shares = [], [], []
        for group in groups:  # a replica that would get no micro-batch of a step is left out of the run
            order = spread(self.accumulation, [r.throughput for r in group])
            used = sorted(set(order))
            self.replicas.append([group[i] for i in used])
            self.assignment.append([used.index(i) for i in order])
            self.shares.append([order.count(i) for i in used])
        self.stages = [group[0] for group in self.replicas]
        steps: dict[str, int] = {}  # each replica's step in this run
        for group, shares in zip(self.replicas, self.shares, strict=True):  # 1. open the run everywhere as it is
            for record, share in zip(group, shares, strict=True):
                steps[record.peer_id] = await self._open(record, share, [r.peer_id for r in group], 0)
        if self.prompts is None:  # (a prompt run's stages are frozen: nothing to replay on them)
            await recover(self, steps)  # a span that missed the last commit replays it (or its lost steps are named)
        for group, shares in zip(self.replicas, self.shares, strict=True):  # 2. replicas behind catch up
            ahead = max(steps[r.peer_id] for r in group)
            ordered = sorted((r.peer_id for r in group), key=lambda p: -steps[p])  # most advanced first
            for record, share in zip(group, shares, strict=True):
                if steps[record.peer_id] < ahead:
                    logger.info("Run %s: replica %s of %d:%d is at step %d, behind %s at step %d: it catches "
                                "up", self.run_id, short_id(record.peer_id), record.start, record.end,
                                steps[record.peer_id], short_id(ordered[0]), ahead)
                    steps[record.peer_id] = await self._open(record, share, ordered, ahead)
        request_steps = [steps[r.peer_id] for group in self.replicas for r in group]
        self._peer_steps, self._opened, self._clean = dict(steps), self._opened + 1, False
        self.run_step = max(run_step, *request_steps)
        logger.info("Run %s: stages %s (their steps: %s)", self.run_id, " -> ".join(
            f"{g[0].start}:{g[0].end}@" + "+".join(f"{short_id(r.peer_id)}" for r in g) for g in self.replicas),
            request_steps)
        return self.stages

    async def _open(self, record: PeerRecord, share: int, replicas: list[str], run_step: int) -> int:
        """Open the run on one replica; a ``run_step`` above its step makes it catch up from the first replica
        listed that is ahead of it (``peers.server.training_rpc``). Returns its step in the run. In a chain it
        also names the adjacent stages' replicas: the only peers it takes pushes from."""
        upstream, downstream = chain.neighbours(self.replicas, record.start, record.end) \
            if self.topology == "chain" else ([], [])
        prompts = self.prompts.count if self.prompts is not None else 0
        if prompts:  # frozen stages: their step count simply follows the run's; they have nothing to checkpoint
            run_step = max(run_step, self.steps_done)
        reply, _ = await self._call(record.peer_id, TrainOpen(
            run_id=self.run_id, start=record.start, end=record.end, optim=self.optim.to_dict(), accumulation=share,
            keep_activations=self.keep_activations, checkpoint_every=0 if prompts else self.checkpoint_every,
            replicas=replicas,
            average_every=self.average_every, outer_lr=self.outer_lr, outer_momentum=self.outer_momentum,
            explicit_apply=True, run_step=run_step, upstream=upstream, downstream=downstream, staleness=self.staleness,
            compression=self.stage_compression.get(self._stage_index(record), self.compression.setting),
            adapter=self.adapter, adapter_seed=self.adapter_seed,
            prompts=prompts, deep_prompts=self.prompts is not None and self.prompts.deep is not None,
        ), None)
        return reply.step

    def _stage_index(self, record: PeerRecord) -> int:
        spans = [(group[0].start, group[0].end) for group in self.replicas]
        return spans.index((record.start, record.end)) if (record.start, record.end) in spans else -1

    async def _adopt_joiners(self) -> None:
        """Add peers that started serving a span of the pipeline since it was chosen, as more replicas of it.

        Only replicas of the spans in use join: switching to another tiling mid-run would hand blocks to peers
        that never trained them. A joiner behind the span's most advanced replica takes that one's parameters and
        step count when the run is opened (``start_async``) and is averaged with the others every H steps.
        """
        self._chosen_at = time.monotonic()
        if self.adapter:  # one peer per span: no replicas join an adapter run
            return
        banned = self.client.router.banned()
        spans = {(group[0].start, group[0].end): i for i, group in enumerate(self.replicas)}
        joiners = [r for r in await self.client._fetch() if (r.start, r.end) in spans and r.peer_id not in banned
                   and r.peer_id not in self._considered]
        if not joiners:
            return
        groups = [list(group) for group in self.replicas]
        for record in joiners:
            groups[spans[(record.start, record.end)]].append(record)
        logger.info("Run %s: %s joined; re-opening the run with them at step %d", self.run_id, ", ".join(
            f"{short_id(r.peer_id)} ({r.start}:{r.end})" for r in joiners), max(self.run_step, self.steps_done))
        considered, current = self._considered, [list(group) for group in self.replicas]
        try:  # a joiner that breaks its stream raises StageFailure: the step's retry re-chooses without it
            await self.start_async(groups=groups)
        except MembershipError:  # we are no member (any more): final, whoever refused
            raise
        except RequestError as e:  # e.g. it trains another trainer's run
            logger.warning("Run %s: a joining peer refused the run (%s); carrying on without the joiners",
                           self.run_id, e)
            await self.start_async(groups=current)
        self._considered |= considered | {r.peer_id for r in joiners}  # not joiners again (nor slow left-outs)

    async def _stage_groups(self, grace: float) -> list[list[PeerRecord]]:
        if self.planner is not None:
            return await self.planner.groups(grace)
        return await stage_groups(self, grace, since=self.broken_since or None)

    async def train_step_async(self, micro_batches: Sequence[torch.Tensor],
                               upcoming: Sequence[torch.Tensor] | None = None) -> StepResult:
        """Run the step's micro-batches (retried on another pipeline if a stage peer fails), then commit it."""
        for batches in (micro_batches, upcoming):
            if batches is not None and len(batches) != self.accumulation:
                raise ValueError(f"a step takes {self.accumulation} micro-batches (accumulation), got {len(batches)}")
        started, failures = time.perf_counter(), 0
        self._gate = self._gate or asyncio.Semaphore(self.in_flight)
        ahead, self._ahead = self._ahead, None
        run: StepRun | None = None
        following: StepRun | None = None
        try:
            if ahead is not None and ahead.batches is not micro_batches:  # not the step started ahead: drop it
                await ahead.cancel()
                ahead, self.stages = None, []  # (re-opening the run forgets its forwards on the stages)
            while True:
                self.attempt += 1
                try:
                    if self.planner is not None:
                        await self.planner.publish()  # its record must outlive the run
                    if not self.stages:
                        await self.start_async()
                    elif self.rechoose_every and self.planner is None and \
                            time.monotonic() - self._chosen_at >= self.rechoose_every:  # (a plan picks its group)
                        await self._adopt_joiners()
                    if ahead is not None and ahead.opened != self._opened:  # the run was re-opened since
                        await ahead.cancel()
                        ahead = None
                    run, ahead = ahead or self._step_run(micro_batches, ahead=False), None
                    if not run.tasks:
                        run.start(self._gate, self._one)
                    if self.staleness and upcoming is not None:
                        following = self._step_run(upcoming, ahead=True)
                        following.start(self._gate, self._one)
                    losses = await run.losses()
                    break
                except StageFailure as failure:
                    for other in (run, following):
                        if other is not None:
                            await other.cancel()
                    run = following = None
                    self.part.zero_grad()  # the trainer's share of the failed attempt is discarded too
                    failures, self.broken_since = failures + 1, self.broken_since or time.monotonic()
                    self._report(failure.peer_id, failure.error, failure.started)
                    # a lone stage's peer that restarts fails every try until it serves again: give up only after
                    # max_retries tries *and* pipeline_wait seconds
                    if failures > self.client.config.max_retries and \
                            time.monotonic() - self.broken_since >= self.pipeline_wait:
                        raise RuntimeError(f"step {self.steps_done} failed {failures} times in "
                                           f"{time.monotonic() - self.broken_since:.0f} s (last: {failure}); check "
                                           "`swarm status` and that peers whose spans tile the model are up"
                                           ) from failure
                    logger.warning("Run %s: %s; re-choosing the stages and retrying step %d", self.run_id, failure,
                                   self.steps_done)
                    await asyncio.sleep(backoff(failures))
                    self.stages = []  # choose again; re-opening the run discards every stage's partial step
            self._record = run.record
            await self._commit(run.stage_steps)
            self._own_step()
            self.steps_done += 1
        except BaseException:
            if following is not None:
                await following.cancel()
            raise
        if self.stages:  # every stage applied it: the run is whole again
            self.broken_since, self._clean = 0.0, True
            if self.planner is not None:
                self.planner.recovered()
        if following is not None:
            if self.stages and following.opened == self._opened:
                following.ready.set()  # its backwards may go: every part applied this step
                self._ahead = following
            else:  # a stage missed the commit: the run is re-opened before the next step, which starts afresh
                await following.cancel()
        busy = [b / len(group) for b, group in zip(run.stage_busy, self.replicas, strict=True)]  # per replica
        return StepResult(sum(losses), sum(int(m[:, 1:].numel()) for m in micro_batches), run.stage_steps,
                          time.perf_counter() - started, busy, [s.peer_id for s in self.stages])

    def _step_run(self, batches: Sequence[torch.Tensor], *, ahead: bool) -> StepRun:
        """The step of ``batches``: the one after the step under way (``ahead``), or the next one now. Staleness 1:
        its weights are those before the last step's update (before the one under way, when ``ahead``); right
        after a (re-)open, the current ones."""
        spans = [(g[0].start, g[0].end) for g in self.replicas]
        common = {"params": self.part.params, "attempt": self.attempt, "opened": self._opened, "ready": not ahead}
        if not self.staleness or not (ahead or self._clean):
            return StepRun(self.steps_done + ahead, batches, spans, **common)
        back = 0 if ahead else 1
        own = self.versions.at(self.part.step_count - back, self.part.step_count)
        at_steps = {peer: step - back for peer, step in self._peer_steps.items()}
        return StepRun(self.steps_done + ahead, batches, spans, own=own, at_steps=at_steps,
                       stale_upto=self.stale_micro_batches, **common)

    async def _one(self, run: StepRun, input_ids: torch.Tensor, index: int) -> float:
        if self.prompts is not None:
            return await prompt_micro_batch(self, run, input_ids, index)
        if self.topology == "chain":
            return await chain.micro_batch(self, run, input_ids, index)
        return await self._micro_batch(run, input_ids, index)

    def _own_step(self) -> None:
        """The trainer part's optimizer step; staleness 1 keeps the weights before it for the next step."""
        before = self.part.step_count
        if self.staleness:
            self.versions.before_step(before)
        try:
            self.part.step()
        finally:
            self.versions.after_step(before)

    async def _commit(self, stage_steps: list[int]) -> None:
        """Phase two: every replica applies its share of the step at once (and averages when due)."""
        calls = [(stage, record.peer_id, TrainApply(run_id=self.run_id, micro_batches=share))
                 for stage, (group, shares) in enumerate(zip(self.replicas, self.shares, strict=True))
                 for record, share in zip(group, shares, strict=True)]
        results = await asyncio.gather(*(self._call(peer_id, message, None) for _, peer_id, message in calls),
                                       return_exceptions=True)
        if final := next((r for r in results if isinstance(r, MembershipError)), None):
            raise final  # we are no member (any more): no ban, no retry
        applied: dict[int, int] = {}  # stage -> the most advanced step of its replicas that applied this one
        for (stage, peer_id, _), result in zip(calls, results, strict=True):
            if isinstance(result, BaseException):  # the others applied theirs: this span catches up or replays
                logger.warning("Run %s: peer %s did not apply step %d: %s", self.run_id, short_id(peer_id),
                               self.steps_done, result)
                self._report(peer_id, result, getattr(result, "started", None))
                self.stages = []  # choose the stages again before the next step
                self.broken_since = self.broken_since or time.monotonic()
            else:
                applied[stage] = max(applied.get(stage, 0), result[0].step)
                self._peer_steps[peer_id] = result[0].step
                stage_steps[stage] = max(stage_steps[stage], result[0].step)
                self.run_step = max(self.run_step, result[0].step)
        record, self._record = self._record, None
        for stage, group in enumerate(self.replicas):
            span = (group[0].start, group[0].end)
            if stage in applied:
                self._span_steps[span] = applied[stage]
                self._unapplied.pop(span, None)
            elif record is not None:  # no peer of this span applied it: keep its share to replay it when it is back
                share = record.stages[stage]
                self._span_steps[span], self._unapplied[span] = share.step + 1, share
                logger.warning("Run %s: no peer of blocks %d:%d applied step %d; it is replayed on them from the "
                               "inputs and gradients kept here once their peer is back", self.run_id, *span,
                               share.step)

    async def _call(self, peer_id: str, message, tensor: torch.Tensor | None):
        """One request to a stage; a broken stream or a timeout becomes ``StageFailure`` (retried elsewhere). A
        refusal raises ``RequestError`` (``NotAdmittedError`` if as no member), failing to be admitted on a new
        stream ``MembershipError``: both final."""
        started = time.monotonic()
        try:
            stream = await self.client.peer_stream(peer_id)
            return await stream.call(message, tensor, self.client.config.request_timeout)
        except RequestError as e:
            error = classify(e)
            if isinstance(error, MovedError):  # it serves another span now: the stages are chosen again, no ban
                raise StageFailure(peer_id, error, started) from None
            raise error from None
        except ChainError as e:  # the peer it names failed, not this one
            raise StageFailure(e.failed_peer, e, started) from e
        except (ConnectionError, TimeoutError, asyncio.TimeoutError, OSError, P2PDaemonError, P2PHandlerError) as e:
            raise StageFailure(peer_id, e, started) from e

    def _report(self, peer_id: str, error: BaseException, started: float | None) -> None:
        """A stage's failure bans its peer; a peer that moved off its span is only left out of the next choice."""
        span = next(((r.start, r.end) for group in self.replicas for r in group if r.peer_id == peer_id), (0, 1))
        report_failure(self.client.router, peer_id, error, span, started)

    def failure(self, peer_id: str, error: BaseException, started: float) -> StageFailure:
        """What a broken stream, a timeout or a chain's ``failed_peer`` becomes: the step is retried without it."""
        return StageFailure(peer_id, error, started)

    async def _micro_batch(self, run: StepRun, input_ids: torch.Tensor, index: int) -> float:
        """Micro-batch ``index`` of the step: forward through a replica of each stage, loss, backward.

        Each replica averages the gradients of its own share of the step's micro-batches (it takes a full
        AdamW step on them); the trainer's part averages over all of them. So the gradient a replica gets is
        scaled by ``accumulation / share`` (exactly 1 with one replica), and scaled back on its way out.
        """
        client, stage_steps, stage_busy, record = self.client, run.stage_steps, run.stage_busy, run.record
        micro_id = f"{run.index}.{index}"
        input_ids = input_ids.to(client.device)
        positions = default_position_ids(input_ids)
        embedded = run.embed(client.embedding, input_ids, positions)  # with grad: the embedding trains here
        hidden, inputs, route = embedded.detach(), [], []
        for stage, group in enumerate(self.replicas):
            replica = self.assignment[stage][index]
            route.append((group[replica].peer_id, self.accumulation / self.shares[stage][replica]))
            inputs.append(hidden)
            self.bytes_sent += hidden.numel() * hidden.element_size()
            message = TrainForward(run_id=self.run_id, micro_id=micro_id, at_step=run.at_step(route[-1][0]))
            reply, hidden = await self._call(route[-1][0], message, hidden)
            stage_busy[stage] += reply.compute_ms / 1e3
            record.forward(stage, index, route[-1][0], inputs[-1], hidden)  # to replay it on a stage that misses it
        last = hidden.to(client.device, client.dtype).requires_grad_(True)
        loss = loss_of(run.head(client.head, last), input_ids) / self.accumulation
        grad, *head_grads = torch.autograd.grad(loss, [last, *run.params], allow_unused=True)
        await run.before_backward()  # staleness 1: the step before is applied everywhere first
        for stage in reversed(range(len(self.replicas))):
            peer_id, scale = route[stage]
            unscaled, grad = grad, grad * scale if scale != 1 else grad
            payload = torch.stack([inputs[stage], grad]) if self.recompute else grad
            self.bytes_sent += payload.numel() * payload.element_size()
            message = TrainBackward(run_id=self.run_id, micro_id=micro_id, recompute=self.recompute)
            reply, grad = await self._call(peer_id, message, payload)
            record.backward(stage, index, unscaled, reply.step)
            grad = grad / scale if scale != 1 else grad
            stage_steps[stage] = max(stage_steps[stage], reply.step)
            stage_busy[stage] += reply.compute_ms / 1e3
        embedding_grads = torch.autograd.grad(embedded, run.params, grad.to(client.device, client.dtype),
                                              allow_unused=True) if run.params else []
        self.part.add(head_grads, embedding_grads)
        return float(loss.detach())
