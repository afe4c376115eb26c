"""Choosing peers: ``make_chain`` (pure path search) and ``Router`` (snapshot, RTTs, bans)."""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from swarm.records import PeerRecord, PeerState

logger = logging.getLogger(__name__)

DEFAULT_RTT = 0.01  # seconds, assumed for a peer we have not measured yet
HOP_PENALTY = 0.002  # seconds per extra hop: serialization and scheduling overhead on both ends


class MissingBlocksError(RuntimeError):
    """No chain of online peers covers the requested blocks."""

    def __init__(self, model: str, blocks: list[int]) -> None:
        self.blocks = blocks
        shown = ", ".join(map(str, blocks[:16])) + (" ..." if len(blocks) > 16 else "")
        super().__init__(
            f"No online peer serves block(s) {shown} of {model}. Start a peer for them, e.g. "
            f"`swarm peer MODEL_DIR --initial_peers ... --block_indices {blocks[0]}:{blocks[-1] + 1}`, "
            f"or wait for the swarm to recover (`swarm status` shows who serves what)."
        )


@dataclass(frozen=True)
class Hop:
    """One peer computing blocks ``[start, end)`` of a chain."""

    peer_id: str
    start: int
    end: int


def make_chain(
    records: Iterable[PeerRecord],
    start: int,
    end: int,
    *,
    rtt: dict[str, float] | None = None,
    banned: Iterable[str] = (),
    model: str = "model",
) -> list[Hop]:
    """The lowest-latency chain of online peers that computes blocks ``[start, end)`` in order.

    Dijkstra over block boundaries: a peer serving ``[a, b)`` is an edge ``s -> e`` for every
    ``a <= s < e <= b``, costing its round trip plus ``(e - s)`` blocks at its per-block speed.
    """
    rtt = rtt or {}
    banned = set(banned)
    peers = [r for r in records if r.state == PeerState.ONLINE and r.peer_id not in banned]
    edges: dict[int, list[tuple[int, float, str]]] = {}
    for r in peers:
        seconds_per_block = 1.0 / r.throughput if r.throughput > 0 else 1.0
        base = rtt.get(r.peer_id, DEFAULT_RTT) + HOP_PENALTY
        for s in range(max(r.start, start), min(r.end, end)):
            for e in range(s + 1, min(r.end, end) + 1):
                edges.setdefault(s, []).append((e, base + (e - s) * seconds_per_block, r.peer_id))

    best: dict[int, float] = {start: 0.0}
    came_from: dict[int, tuple[int, str]] = {}
    queue = [(0.0, start)]
    while queue:
        cost, position = heapq.heappop(queue)
        if position == end:
            break
        if cost > best.get(position, float("inf")):
            continue
        for nxt, edge_cost, peer_id in edges.get(position, ()):
            new_cost = cost + edge_cost
            if new_cost < best.get(nxt, float("inf")):
                best[nxt] = new_cost
                came_from[nxt] = (position, peer_id)
                heapq.heappush(queue, (new_cost, nxt))
    if end not in best:
        covered = {b for r in peers for b in range(r.start, r.end)}
        raise MissingBlocksError(model, [b for b in range(start, end) if b not in covered] or [start])

    hops, position = [], end
    while position != start:
        prev, peer_id = came_from[position]
        hops.append(Hop(peer_id, prev, position))
        position = prev
    return hops[::-1]


GRACE_POLL = 0.5  # seconds between snapshots while waiting for a span's peers to reappear


class Router:
    """Keeps a fresh snapshot of the swarm, measured RTTs and a ban list with growing backoff."""

    def __init__(
        self,
        fetch: Callable[[], Awaitable[list[PeerRecord]]],
        *,
        model: str,
        refresh_period: float = 5.0,
        ban_time: float = 2.0,
        max_ban_time: float = 60.0,
        missing_grace: float = 3.0,
    ) -> None:
        self._fetch, self.model, self.missing_grace = fetch, model, missing_grace
        self.refresh_period, self.ban_time, self.max_ban_time = refresh_period, ban_time, max_ban_time
        self.records: list[PeerRecord] = []
        self._fetched_at = -float("inf")
        self.rtt: dict[str, float] = {}
        self._bans: dict[str, tuple[float, float]] = {}  # peer -> (banned until, last ban duration)

    async def refresh(self, force: bool = False) -> list[PeerRecord]:
        if force or time.monotonic() - self._fetched_at > self.refresh_period:
            self.records = await self._fetch()
            self._fetched_at = time.monotonic()
        return self.records

    def banned(self) -> set[str]:
        now = time.monotonic()
        return {peer for peer, (until, _) in self._bans.items() if until > now}

    def on_failure(self, peer_id: str, error: BaseException | None = None) -> None:
        """Ban ``peer_id``; each consecutive failure doubles the ban, up to ``max_ban_time``."""
        _, last = self._bans.get(peer_id, (0.0, 0.0))
        duration = min(self.max_ban_time, last * 2 if last else self.ban_time)
        self._bans[peer_id] = (time.monotonic() + duration, duration)
        logger.info("Banned peer ...%s for %.1f s after: %s", peer_id[-6:], duration, error)
        logger.debug("Failure of peer %s", peer_id, exc_info=error)

    def on_success(self, peer_id: str, rtt: float | None = None) -> None:
        """Lift any ban and fold a measured round trip into the peer's RTT estimate (EMA)."""
        self._bans.pop(peer_id, None)
        if rtt is not None:
            old = self.rtt.get(peer_id)
            self.rtt[peer_id] = rtt if old is None else 0.8 * old + 0.2 * rtt

    async def _wait_for_records(self, start: int, end: int) -> None:
        """Give the swarm ``missing_grace`` seconds to show peers for ``[start, end)`` (banned or not): a peer
        whose heartbeat is late under load drops out of the DHT for a moment. Raises ``MissingBlocksError``."""
        for attempt in range(int(self.missing_grace / GRACE_POLL) + 1):
            if attempt:
                await asyncio.sleep(GRACE_POLL)
                await self.refresh(force=True)
            try:
                make_chain(self.records, start, end, rtt=self.rtt, model=self.model)
                return
            except MissingBlocksError:
                if attempt == int(self.missing_grace / GRACE_POLL):
                    raise

    async def make_chain(self, start: int, end: int) -> list[Hop]:
        """A chain for ``[start, end)``.

        If the cached snapshot has none, refresh it; if only banned peers could serve the span, wait for the
        earliest of their bans to end (a transient failure of every replica must not fail the request).
        """
        await self.refresh()
        try:
            return make_chain(self.records, start, end, rtt=self.rtt, banned=self.banned(), model=self.model)
        except MissingBlocksError:
            await self.refresh(force=True)
        try:
            return make_chain(self.records, start, end, rtt=self.rtt, banned=self.banned(), model=self.model)
        except MissingBlocksError:
            await self._wait_for_records(start, end)  # raises if nobody serves the span, banned or not
            now = time.monotonic()
            wait = min((until for until, _ in self._bans.values() if until > now), default=now) - now
            logger.info("Every peer that serves blocks %d:%d is banned; retrying in %.1f s", start, end, wait)
            await asyncio.sleep(max(0.0, wait))
            return make_chain(self.records, start, end, rtt=self.rtt, banned=self.banned(), model=self.model)
