"""Replicas of a stage average their parameters every H local steps (DiLoCo-style), over encrypted streams.

Each replica of a span trains on its share of the micro-batches with its own AdamW (the inner optimizer).
Every ``average_every`` local steps it sends its flat parameters to the run's other replicas of the span
(``ParamsPush`` on the same admitted, AES-GCM streams the trainer uses: a private swarm's averaging is as
private as its activations), waits for theirs, and takes the mean in peer-id order, so replicas that got
the same set compute bit-identical results. The outer optimizer is Nesterov SGD on ``anchor - mean``
(``outer_lr=1, outer_momentum=0`` is plain averaging); a replica that does not answer in time is left out
of that round and the others go on, and one that our push cannot reach (its peer is gone) is not waited for.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import torch

from peers.core.finite import all_finite
from peers.wire.messages import ParamsPush
from privacy.peer_ids import short_id

logger = logging.getLogger(__name__)

StreamFor = Callable[[str], Awaitable]  # peer id -> an open PeerStream to it


class ReplicaAverager:
    """Averaging rounds of one run's replica of a span; ``receive`` is fed by the stream handler."""

    def __init__(self, own_peer_id: str, run_id: str, replicas: list[str], stream_for: StreamFor, *,
                 outer_lr: float = 1.0, outer_momentum: float = 0.0, timeout: float = 30.0,
                 anchor: torch.Tensor | None = None) -> None:
        self.own_peer_id, self.run_id, self.replicas = own_peer_id, run_id, sorted(set(replicas) - {own_peer_id})
        self.stream_for, self.timeout = stream_for, timeout
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self._inbox: dict[int, dict[str, torch.Tensor]] = {}
        self._arrived: dict[int, asyncio.Event] = {}
        # parameters after the previous round (at first: when the run opened, the same on every replica)
        self._anchor = None if anchor is None else anchor.detach().to(torch.float32).clone()
        self._velocity: torch.Tensor | None = None
        self.rounds = 0
        self.last_group = 0  # replicas averaged in the last round (self included)

    def receive(self, sender: str, round_: int, flat: torch.Tensor, numel: int) -> None:
        """A replica's parameters for ``round_``; refuses strangers, wrong sizes and non-finite values."""
        if sender not in self.replicas:
            raise ValueError(f"peer {short_id(sender)} is not a replica of this span in run {self.run_id!r}")
        if flat.ndim != 1 or flat.numel() != numel or not flat.is_floating_point():
            raise ValueError(f"parameters must be a flat float tensor of {numel} values, got {list(flat.shape)}")
        if not all_finite([flat]):
            raise ValueError("parameters contain NaN or infinite values")
        if round_ < self.rounds:
            raise ValueError(f"round {round_} is over (this replica is at round {self.rounds})")
        self._inbox.setdefault(round_, {})[sender] = flat.to(torch.float32)
        self._event(round_).set()

    async def average(self, flat: torch.Tensor) -> torch.Tensor:
        """One round: push ``flat`` to the replicas, wait for theirs, return the new parameters."""
        round_ = self.rounds
        if self._anchor is None:
            self._anchor = flat.detach().to(torch.float32).clone()
        unreachable: set[str] = set()  # replicas our push could not reach: gone, so not waited for

        async def push(peer: str) -> None:
            if not await self._push(peer, round_, flat):
                unreachable.add(peer)
                self._event(round_).set()

        pushes = [asyncio.ensure_future(push(peer)) for peer in self.replicas]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        while len(self._inbox.get(round_, {}).keys() | unreachable) < len(self.replicas) and loop.time() < deadline:
            event = self._event(round_)
            event.clear()
            try:
                await asyncio.wait_for(event.wait(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                break
        await asyncio.gather(*pushes, return_exceptions=True)
        received = self._inbox.pop(round_, {})
        self._arrived.pop(round_, None)
        members = {self.own_peer_id: flat.detach().to(torch.float32), **received}
        total = torch.zeros_like(self._anchor)
        for peer in sorted(members):
            total += members[peer]
        mean = total / len(members)
        missing = sorted(set(self.replicas) - set(received))
        if missing:
            logger.warning("Run %r round %d: no parameters from %s (%s); averaged %d replica(s)", self.run_id, round_,
                           ", ".join(f"{short_id(p)}" for p in missing),
                           "unreachable" if set(missing) <= unreachable else f"none within {self.timeout:.0f} s",
                           len(members))
        new = self._outer_step(mean)
        self.rounds, self.last_group = round_ + 1, len(members)
        logger.info("Run %r: averaging round %d over %d replica(s)", self.run_id, round_, len(members))
        return new.to(flat.dtype)

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

    async def _push(self, peer: str, round_: int, flat: torch.Tensor) -> bool:
        """Send our parameters to ``peer``; False if it could not be reached or refused them."""
        try:
            stream = await self.stream_for(peer)
            await stream.call(ParamsPush(run_id=self.run_id, round=round_), flat, self.timeout)
            return True
        except Exception as e:
            logger.warning("Run %r round %d: could not send parameters to %s: %s", self.run_id, round_,
                           short_id(peer), e)
            return False

    def _event(self, round_: int) -> asyncio.Event:
        return self._arrived.setdefault(round_, asyncio.Event())
