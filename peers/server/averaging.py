"""Replicas of a stage average their parameters every H local steps (DiLoCo-style), over encrypted streams.

Each replica of a span trains on its share of the micro-batches with its own AdamW (the inner optimizer).
Every ``average_every`` local steps it sends its flat parameters to the run's other replicas of the span
(``ParamsPush`` on the same admitted, AES-GCM streams the trainer uses: a private swarm's averaging is as
private as its activations), waits for theirs, and takes the mean in peer-id order, so replicas that got
the same set compute bit-identical results. The outer optimizer is Nesterov SGD on ``anchor - mean``
(``outer_lr=1, outer_momentum=0`` is plain averaging); a replica that does not answer in time is left out
of that round and the others go on, and one that our push cannot reach (its peer is gone) is not waited for.

A round is named by the step it follows (``round_at(step, every)``: step 8 with H = 4 is round 2), not counted
by each replica: a replica that rejoins a run counts its steps from the run's, so its rounds line up with the
others' however often its averager was re-made. A push for a round that is over here is refused, and its
sender (behind us) is not waited for in our round: neither side waits out the timeout for the other.

Under a run's compression setting other than "none", a replica pushes its compressed delta from the anchor with
error feedback instead of its parameters (``peers.server.averaging_delta``); "none" pushes the parameters as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import torch

from peers.core.finite import all_finite
from peers.server.averaging_delta import ANCHOR_REFUSED, MAX_DIGEST, DeltaCompression, Prepared, anchor_digest
from peers.wire.errors import RequestError
from peers.wire.messages import ParamsPush
from privacy.peer_ids import short_id
from swarm.links import LinkTable

logger = logging.getLogger(__name__)

MAX_ROUNDS_AHEAD = 2  # pushes for rounds further ahead of ours are refused (a replica cannot fill our memory)

StreamFor = Callable[[str], Awaitable]  # peer id -> an open PeerStream to it


def round_at(step: int, every: int) -> int:
    """The averaging round that follows optimizer step ``step`` (a multiple of ``every``)."""
    return step // every


class ReplicaAverager:
    """Averaging rounds of one run's replica of a span; ``receive`` is fed by the stream handler."""

    def __init__(self, own_peer_id: str, run_id: str, replicas: list[str], stream_for: StreamFor, *,
                 outer_lr: float = 1.0, outer_momentum: float = 0.0, timeout: float = 30.0,
                 anchor: torch.Tensor | None = None, first_round: int = 0, compression: str = "none",
                 links: LinkTable | None = None, error_feedback: bool = True) -> None:
        self.own_peer_id, self.run_id, self.replicas = own_peer_id, run_id, sorted(set(replicas) - {own_peer_id})
        self.stream_for, self.timeout = stream_for, timeout
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self._inbox: dict[int, dict[str, torch.Tensor]] = {}
        self._arrived: dict[int, asyncio.Event] = {}
        # parameters after the previous round (at first: when the run opened, the same on every replica)
        self._anchor = None if anchor is None else anchor.detach().to(torch.float32).clone()
        # compressed rounds (``averaging_delta``): deltas from the anchor, whose digest is kept with it
        self.compression = DeltaCompression(compression, links, error_feedback=error_feedback)
        if self.compression.active and self._anchor is not None:
            self._anchor = self._anchor.cpu()
        self._digest: tuple[torch.Tensor, str] | None = None  # (the anchor it is of, its digest)
        self._velocity: torch.Tensor | None = None
        self.rounds = first_round  # the next round this replica averages in (pushes for earlier ones are refused)
        self._behind: dict[str, int] = {}  # replica that pushed a round that was over -> our round it is excused from
        self.last_group = 0  # replicas averaged in the last round (self included)

    def receive(self, sender: str, round_: int, flat: torch.Tensor, numel: int, anchor: str = "") -> None:
        """A replica's parameters for ``round_`` (with ``anchor``: its delta from the anchor of that digest); refuses
        strangers, wrong sizes, non-finite values and a delta from another anchor than ours for ``round_``."""
        if sender not in self.replicas:
            raise ValueError(f"peer {short_id(sender)} is not a replica of this span in run {self.run_id!r}")
        if flat.ndim != 1 or flat.numel() != numel or not flat.is_floating_point():
            raise ValueError(f"parameters must be a flat float tensor of {numel} values, got {list(flat.shape)}")
        if not all_finite([flat]):
            raise ValueError("parameters contain NaN or infinite values")
        if round_ < self.rounds:
            self._behind[sender] = self.rounds  # it is behind us: our current round does not wait for it
            for event in self._arrived.values():
                event.set()
            raise ValueError(f"round {round_} is over (this replica is at round {self.rounds}; a round is the step "
                             "it follows divided by average_every: are the replicas' step counts different?)")
        if round_ > self.rounds + MAX_ROUNDS_AHEAD:  # each round held costs a copy of the parameters
            raise ValueError(f"round {round_} is too far ahead (this replica is at round {self.rounds}; at most "
                             f"{MAX_ROUNDS_AHEAD} ahead are kept)")
        member = flat.to(torch.float32) if not anchor else self._rebuild(round_, flat, anchor)
        self._behind.pop(sender, None)
        self._inbox.setdefault(round_, {})[sender] = member
        self._event(round_).set()

    async def average(self, flat: torch.Tensor, round_: int | None = None) -> torch.Tensor:
        """Round ``round_`` (default: the next): push ``flat`` to the replicas, wait for theirs, return the new
        parameters."""
        round_ = self.rounds = self.rounds if round_ is None else max(round_, self.rounds)  # earlier ones are over
        for stale in [r for r in self._inbox if r < round_]:  # pushes for rounds we skipped
            self._inbox.pop(stale)
            self._arrived.pop(stale, None)
        compressed = self.compression.active
        if self._anchor is None:
            self._anchor = flat.detach().to("cpu" if compressed else flat.device, torch.float32).clone()
        prepared = self.compression.prepare(flat, self._anchor, self.digest(), self.replicas) \
            if compressed else None
        unreachable: set[str] = set()  # replicas our push could not reach: gone, so not waited for

        async def push(peer: str) -> None:
            if not await self._push(peer, round_, flat if prepared is None else prepared):
                unreachable.add(peer)
                self._event(round_).set()

        pushes = [asyncio.ensure_future(push(peer)) for peer in self.replicas]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout

        def behind() -> set[str]:
            return {peer for peer, excused in self._behind.items() if excused == round_}

        def settled() -> set[str]:  # replicas whose parameters came, or that are gone, or behind this round
            return self._inbox.get(round_, {}).keys() | unreachable | behind()

        while len(settled()) < len(self.replicas) and loop.time() < deadline:
            event = self._event(round_)
            event.clear()
            try:
                await asyncio.wait_for(event.wait(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                break
        await asyncio.gather(*pushes, return_exceptions=True)
        received = self._inbox.pop(round_, {})
        self._arrived.pop(round_, None)
        # compressed: our member is what the others received from us (anchor + decoded delta), not our parameters
        own = flat.detach().to(torch.float32) if prepared is None else prepared.member
        members = {self.own_peer_id: own, **received}
        total = torch.zeros_like(self._anchor)
        for peer in sorted(members):
            total += members[peer].to(total.device)
        mean = total / len(members)
        missing = sorted(set(self.replicas) - set(received))
        if missing:
            why = ("unreachable" if set(missing) <= unreachable else "behind: it pushed an earlier round"
                   if set(missing) <= unreachable | behind() else f"none within {self.timeout:.0f} s")
            logger.warning("Run %r round %d: no parameters from %s (%s); averaged %d replica(s)", self.run_id, round_,
                           ", ".join(f"{short_id(p)}" for p in missing), why, len(members))
        new = self._outer_step(mean)
        self.rounds, self.last_group = round_ + 1, len(members)
        self.compression.round_done()
        logger.info("Run %r: averaging round %d over %d replica(s)%s", self.run_id, round_, len(members),
                    "" if prepared is None else f" (our delta in {prepared.codec})" if prepared.anchor else
                    " (our parameters in full)")
        return new.to(flat.device, flat.dtype)

    def digest(self) -> str:
        """The digest of our anchor (``averaging_delta.anchor_digest``), computed once per anchor."""
        if self._anchor is None:
            return ""
        if self._digest is None or self._digest[0] is not self._anchor:
            self._digest = (self._anchor, anchor_digest(self._anchor))
        return self._digest[1]

    def _rebuild(self, round_: int, delta: torch.Tensor, anchor: str) -> torch.Tensor:
        """A replica's member from its delta: our anchor plus the delta, if our anchor for ``round_`` is its."""
        if round_ != self.rounds or self._anchor is None:
            raise ValueError(f"{ANCHOR_REFUSED}: a delta for round {round_} needs this replica's anchor for that "
                             f"round, not known yet (it is at round {self.rounds}); send the parameters in full")
        ours = self.digest()
        if anchor != ours:
            raise ValueError(f"{ANCHOR_REFUSED}: the delta is from anchor {anchor[:MAX_DIGEST]!r}, this replica's "
                             f"for round {round_} is {ours!r} (the replicas averaged different groups or opened from "
                             "different weights); send the parameters in full")
        return self._anchor.cpu() + delta.to("cpu", torch.float32)

    def _outer_step(self, mean: torch.Tensor) -> torch.Tensor:
        """Nesterov SGD on the outer gradient ``anchor - mean`` (DiLoCo); plain mean with lr 1, momentum 0."""
        if self.outer_lr == 1.0 and not self.outer_momentum:  # plain averaging: exactly the mean on every replica
            self._anchor = mean
            return mean.clone()
        delta = self._anchor - mean
        if self.outer_momentum:
            self._velocity = delta.clone() if self._velocity is None else self.outer_momentum * self._velocity + delta
            delta = delta + self.outer_momentum * self._velocity
        self._anchor = self._anchor - self.outer_lr * delta
        return self._anchor.clone()

    async def _push(self, peer: str, round_: int, flat: torch.Tensor | Prepared) -> bool:
        """Send our parameters (or our prepared delta) to ``peer``; False if it could not be reached or refused
        them. A delta refused for its anchor goes again as our member in full."""
        try:
            stream = await self.stream_for(peer)
            if not isinstance(flat, Prepared):
                await stream.call(ParamsPush(run_id=self.run_id, round=round_), flat, self.timeout)
                return True
            try:
                await stream.call(ParamsPush(run_id=self.run_id, round=round_, anchor=flat.anchor), flat.payload,
                                  self.timeout)
            except RequestError as e:
                if not flat.anchor or ANCHOR_REFUSED not in str(e):
                    raise
                logger.info("Run %r round %d: %s refused our delta (%s); sending our parameters in full",
                            self.run_id, round_, short_id(peer), e)
                await stream.call(ParamsPush(run_id=self.run_id, round=round_), flat.member, self.timeout)
            return True
        except Exception as e:
            logger.warning("Run %r round %d: could not send parameters to %s: %s", self.run_id, round_,
                           short_id(peer), e)
            return False

    def _event(self, round_: int) -> asyncio.Event:
        return self._arrived.setdefault(round_, asyncio.Event())
