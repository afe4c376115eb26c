"""Replaying a step on a stage that did not apply it, so that no step is ever half-applied.

Every activation and gradient of a step passes through the trainer. For the step being committed it keeps, per
stage and micro-batch, the input it sent, the output it got back and the output gradient it sent (unscaled),
and the order in which the stage ran the backwards (gradients are summed in that order). Once every stage has
applied the step, that is dropped. A stage whose peer did not apply it (it died between its last backward and
the commit, or refused the commit) while the other stages did keeps its share (``StageShare``). When a peer
serves that span again at the step before (a restart from its ``--checkpoint_dir``, which peers write on every
applied step with ``checkpoint_every = 1``), the trainer opens the run on that peer alone, sends the same
forwards and backwards in the same order and commits: the weights and AdamW state it would have had, bit for bit
on the same kernels. The replayed forwards are compared with the first ones, which checks that the peer held the
same weights. A span that comes back further behind cannot be replayed: those steps of its blocks are lost, and
the trainer says so loudly (``SwarmTrainer.lost_steps``) and how to avoid it.

With replicas, a replica that misses a commit while another applied it takes that one's parameters when it
rejoins (``peers.server.training_rpc``), as between averaging rounds; only a span none of whose replicas applied the
step is replayed (on one of them, with all of the span's micro-batches).

In a chain (``peers.trainer.chain``) the trainer sees only the first stage's input and the last stage's output and
grad; the stages keep what they exchanged with each other in the last step they applied, and a replay first fetches
the missing tensors from the replayed stage's neighbours (``fill``, ``TrainFetch``), then runs as in a star: the
rare replay sends its stage's inputs and grads over the trainer's link, the steps themselves never do.

Memory: until the commit, the trainer holds each stage's inputs, outputs and gradients of the step (about three
hidden-state tensors per stage and micro-batch); afterwards only those of a stage that did not apply it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from peers.wire.messages import TrainApply, TrainBackward, TrainFetch, TrainForward
from privacy.peer_ids import short_id
from swarm.records import PeerRecord

logger = logging.getLogger(__name__)


@dataclass
class MicroRecord:
    """One micro-batch as one stage saw it."""

    peer_id: str  # the replica that computed it
    hidden: torch.Tensor | None  # its input (chain: None until fetched from its upstream, unless the trainer's)
    output: torch.Tensor | None = None
    grad: torch.Tensor | None = None  # the gradient of its output, unscaled (as for a lone stage)
    # chain: the micro-batch's id and its route neighbours ("" = the trainer), who kept what the trainer did not see
    micro_id: str = ""
    upstream: str = ""
    downstream: str = ""
    backward_done: bool = False


@dataclass
class StageShare:
    """What one stage (a span) saw of one step: enough to run that step on it again."""

    start: int
    end: int
    step: int = 0  # the stage's step count before this step (what its backwards reported)
    micro: dict[int, MicroRecord] = field(default_factory=dict)
    order: list[int] = field(default_factory=list)  # micro-batches in the order the stage ran their backwards

    @property
    def span(self) -> tuple[int, int]:
        return self.start, self.end

    def complete(self) -> bool:
        """Every micro-batch's backward ran (in a chain, some tensors are still on the neighbours: ``fill``)."""
        return bool(self.order) and len(self.order) == len(self.micro) and \
            all(m.grad is not None or m.backward_done for m in self.micro.values())


class StepRecord:
    """Each stage's share of the step being run (``SwarmTrainer._micro_batch`` fills it)."""

    def __init__(self, spans: list[tuple[int, int]]) -> None:
        self.stages = [StageShare(start, end) for start, end in spans]

    def forward(self, stage: int, index: int, peer_id: str, hidden: torch.Tensor | None, output: torch.Tensor | None,
                **chain: str) -> None:
        self.stages[stage].micro[index] = MicroRecord(peer_id, hidden, output, **chain)

    def ran(self, stage: int, index: int) -> None:
        """The stage runs micro-batch ``index``'s backward next (a chain: known when it is sent)."""
        self.stages[stage].order.append(index)

    def backward(self, stage: int, index: int, grad: torch.Tensor | None, step: int, ordered: bool = True) -> None:
        share = self.stages[stage]
        micro = share.micro[index]
        micro.grad, micro.backward_done = None if grad is None else grad.detach(), True
        if ordered:
            share.order.append(index)
        share.step = max(share.step, step)


class Trainer(Protocol):
    """What this needs of ``peers.trainer.swarm_trainer.SwarmTrainer``."""

    run_id: str
    replicas: list[list[PeerRecord]]
    shares: list[list[int]]
    replayed: int
    lost_steps: list[dict]
    _span_steps: dict[tuple[int, int], int]
    _unapplied: dict[tuple[int, int], StageShare]

    async def _open(self, record: PeerRecord, share: int, replicas: list[str], run_step: int) -> int: ...

    async def _call(self, peer_id: str, message: Any, tensor: torch.Tensor | None) -> Any: ...


async def replay(trainer: Trainer, share: StageShare, target: PeerRecord) -> int:
    """Run ``share`` (a step its span did not apply) on ``target`` alone and commit it; returns its step after.

    The run is opened on it without its replicas (no averaging round inside the replay); the caller re-opens it
    with them afterwards. A broken stream raises ``StageFailure`` like any step: the replay is retried."""
    run_id, peer_id = trainer.run_id, target.peer_id
    await trainer._open(target, len(share.order), [peer_id], 0)
    worst, compared = 0.0, 0
    for index in share.order:
        micro = share.micro[index]
        micro_id = f"replay-{share.step}.{index}"
        _, output = await trainer._call(peer_id, TrainForward(run_id=run_id, micro_id=micro_id), micro.hidden)
        if micro.peer_id == peer_id and micro.output is not None:  # the same peer: the same weights, the same bits
            same_shape = output.shape == micro.output.shape
            worst = max(worst, (output - micro.output).abs().max().item() if same_shape else math.inf)
            compared += 1
        await trainer._call(peer_id, TrainBackward(run_id=run_id, micro_id=micro_id), micro.grad)
    reply, _ = await trainer._call(peer_id, TrainApply(run_id=run_id, micro_batches=len(share.order)), None)
    if worst:
        logger.warning("Run %s: replayed step %d of blocks %d:%d on %s, but its forwards differ from the first "
                       "time's by up to %.3g: its weights were not those of step %d, so the replayed step is close, "
                       "not exact", run_id, share.step, share.start, share.end, short_id(peer_id), worst, share.step)
    logger.info("Run %s: replayed step %d of blocks %d:%d on %s (%d micro-batch(es)%s): it is at step %d like "
                "the other stages", run_id, share.step, share.start, share.end, short_id(peer_id), len(share.order),
                ", forwards identical to the first time's" if compared and not worst else "", reply.step)
    return reply.step


async def fill(trainer: Trainer, share: StageShare) -> bool:
    """Chain: fetch what the trainer did not see of ``share`` from the neighbours that kept it (the input from the
    stage before, the output and its grad from the stage after, ``peers.server.training_chain``); False (and a
    warning) if one of them cannot give it."""
    async def fetch(peer_id: str, micro_id: str, what: str) -> torch.Tensor:
        if not peer_id:
            raise ValueError(f"no record of the {what} of micro-batch {micro_id}")
        _, tensor = await trainer._call(peer_id, TrainFetch(run_id=trainer.run_id, micro_id=micro_id, what=what), None)
        if tensor is None:
            raise ValueError(f"peer {short_id(peer_id)} sent no {what} of micro-batch {micro_id}")
        return tensor

    try:
        for micro in share.micro.values():
            if micro.hidden is None:
                micro.hidden = await fetch(micro.upstream, micro.micro_id, "output")
            if micro.output is None and micro.downstream:
                micro.output = await fetch(micro.downstream, micro.micro_id, "input")
            if micro.grad is None:
                micro.grad = await fetch(micro.downstream, micro.micro_id, "grad")
    except Exception as e:  # a neighbour is gone too, or forgot: the step cannot be replayed
        logger.warning("Run %s: cannot replay step %d of blocks %d:%d: what its neighbours kept of it is not "
                       "available (%s)", trainer.run_id, share.step, share.start, share.end, e)
        return False
    return True


async def recover(trainer: Trainer, steps: dict[str, int]) -> None:
    """Bring each span of the run to the step the run expects of it; ``steps``: each replica's step now.

    A span none of whose peers applied the last step, and that is back at the step before, replays it on one of
    them (the peer that ran it the first time, if it is back: its forwards are checked). A span further behind has
    lost steps: an error says so and how to avoid it, and ``trainer.lost_steps`` keeps it."""
    for group, shares in zip(trainer.replicas, trainer.shares, strict=True):
        span, best = (group[0].start, group[0].end), max(steps[r.peer_id] for r in group)
        expected, share = trainer._span_steps.setdefault(span, best), trainer._unapplied.get(span)
        if best < expected and share is not None and share.complete() and best == share.step == expected - 1 \
                and await fill(trainer, share):
            at_best = [r for r in group if steps[r.peer_id] == best]
            ran_it = {m.peer_id for m in share.micro.values()}
            target = next((r for r in at_best if r.peer_id in ran_it), at_best[0])
            steps[target.peer_id] = best = await replay(trainer, share, target)
            trainer.replayed += 1
            if len(group) > 1:  # it was opened alone for the replay: open it with its replicas again
                others = [r.peer_id for r in group if r is not target]
                await trainer._open(target, shares[group.index(target)], [target.peer_id, *others], 0)
        elif best < expected:
            message = lost_steps_message(trainer.run_id, span, {r.peer_id: steps[r.peer_id] for r in group}, expected)
            logger.error(message)
            trainer.lost_steps.append({"blocks": f"{span[0]}:{span[1]}", "step": best, "run_expected": expected,
                                       "lost": expected - best, "message": message})
        trainer._span_steps[span] = best
        trainer._unapplied.pop(span, None)


def lost_steps_message(run_id: str, span: tuple[int, int], peers: dict[str, int], expected: int) -> str:
    """Why a span is behind the run and what would have kept its steps."""
    best = max(peers.values())
    holders = ", ".join(f"{short_id(p)} at step {s}" for p, s in peers.items())
    return (f"Run {run_id}: blocks {span[0]}:{span[1]} LOST {expected - best} step(s): the run expects them at step "
            f"{expected}, but the peer(s) serving them now ({holders}) came back from an older checkpoint or hold "
            f"other weights, so steps {best + 1}..{expected} of these blocks cannot be replayed. Training goes on with "
            f"them {expected - best} step(s) behind the other stages. To lose nothing when a peer restarts, let peers "
            f"checkpoint every step (checkpoint_every = 1, peers started with --checkpoint_dir), and serve the span "
            f"on a second peer (a replica takes over at once)")
