"""Choosing peers: ``make_chain`` (pure path search) and ``Router`` (snapshot, RTTs, bans, busy peers)."""

from __future__ import annotations

import asyncio
import copy
import heapq
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from privacy.peer_ids import short_id
from swarm.estimator import ModelShape
from swarm.links import LinkTable
from swarm.plan.route import plan_route
from swarm.plan.types import Plan
from swarm.records import PeerRecord, PeerState

logger = logging.getLogger(__name__)

DEFAULT_RTT = 0.01  # seconds of network round trip assumed for a peer we have not measured yet
HOP_PENALTY = 0.002  # seconds per extra hop: serialization and scheduling overhead on both ends


class NoRouteError(RuntimeError):
    """No chain of peers can compute the requested blocks now; the subclass says why."""


class MissingBlocksError(NoRouteError):
    """No online peer serves the requested blocks (banned or not)."""

    def __init__(self, model: str, blocks: list[int]) -> None:
        self.blocks = blocks
        shown = ", ".join(map(str, blocks[:16])) + (" ..." if len(blocks) > 16 else "")
        super().__init__(
            f"No online peer serves block(s) {shown} of {model}. Start a peer for them, e.g. "
            f"`swarm peer MODEL_DIR --initial_peers ... --block_indices {blocks[0]}:{blocks[-1] + 1}`, "
            f"or wait for the swarm to recover (`swarm status` shows who serves what)."
        )


class PrivateSwarmError(NoRouteError):
    """The model's records are sealed: this node is not a member of the private swarm that wrote them."""

    def __init__(self, model: str, sealed: int) -> None:
        self.sealed = sealed
        super().__init__(
            f"this swarm is private: {sealed} sealed record(s) under {model}'s DHT key could not be read "
            f"(only members of the private swarm can read them). Join it with --private CREDENTIALS "
            f"--identity_path ID, the files of its owner's `swarm invite` (in Python: "
            f"SwarmConfig(credentials_path=..., identity_path=...))."
        )


@dataclass(frozen=True)
class Unavailable:
    """Why an online peer is left out of routing for now: banned after a failure, or busy (e.g. cache full)."""

    peer_id: str
    state: str  # "banned" or "busy"
    seconds_left: float
    error: str  # the failure or refusal that caused it


class PeersUnavailableError(NoRouteError):
    """Online peers serve the blocks, but every one of them is banned after a failure or busy."""

    def __init__(self, model: str, start: int, end: int, peers: list[Unavailable]) -> None:
        self.start, self.end, self.peers = start, end, peers
        states = " or ".join(sorted({p.state for p in peers}))
        super().__init__(
            f"all {len(peers)} peer(s) serving blocks {start}:{end} of {model} are {states}: {describe(peers)}. "
            f"Retry in a moment, or start another peer for them (`swarm peer MODEL_DIR --initial_peers ... "
            f"--block_indices {start}:{end}`); `swarm status` shows who serves what."
        )


def describe(peers: Iterable[Unavailable]) -> str:
    """``...abc123 banned until 12:00:03 (last error: ...); ...`` for error messages."""
    now = datetime.now()
    return "; ".join(f"{short_id(p.peer_id)} {p.state} until {(now + timedelta(seconds=p.seconds_left)):%H:%M:%S} "
                     f"(last error: {_short(p.error)})" for p in peers)


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(error: BaseException | None) -> str:
    return "unknown" if error is None else str(error) or type(error).__name__


@dataclass(frozen=True)
class Hop:
    """One peer computing blocks ``[start, end)`` of a chain."""

    peer_id: str
    start: int
    end: int


def _same_kind(records: list[PeerRecord], kept: list[PeerRecord]) -> list[PeerRecord]:
    """``kept`` as the same kind of list as ``records`` (a discovery ``Snapshot`` keeps its ``sealed`` count)."""
    result = copy.copy(records)
    result[:] = kept
    return result


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
    ``a <= s < e <= b``, costing its network round trip ``rtt`` (compute excluded: measured as wall time minus
    the peer's reported compute, see ``swarm.links``) plus ``(e - s)`` blocks at its per-block compute from its
    record (``PeerRecord.seconds_per_block``). Compute is counted once.
    """
    rtt = rtt or {}
    banned = set(banned)
    peers = [r for r in records if r.state == PeerState.ONLINE and r.peer_id not in banned]
    edges: dict[int, list[tuple[int, float, str]]] = {}
    for r in peers:
        seconds_per_block = r.seconds_per_block
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
MOVED_MEMORY = 60.0  # seconds a moved peer's stale record (still naming the span it left) is ignored


@dataclass(frozen=True)
class Ban:
    """A peer left out of routing after a failure, until ``until`` (``time.monotonic()``)."""

    until: float
    duration: float  # the next ban, for a new failure after this one ended, is twice as long
    since: float  # when it began: a request sent before then failed in the same failure event
    error: str


class Router:
    """Keeps a fresh snapshot of the swarm, measured links (``links``: network time only, fed by the client's
    streams), bans with growing backoff and busy marks.

    One router serves every session of a client (and its trainer), so several of them often see the same
    failure at once (a killed peer breaks every stream to it): a failure is one event, one ban, however many
    report it. A refusal for capacity (cache full) is no failure: the peer is only marked busy for ``busy_time``.
    """

    def __init__(
        self,
        fetch: Callable[[], Awaitable[list[PeerRecord]]],
        *,
        model: str,
        refresh_period: float = 5.0,
        ban_time: float = 2.0,
        max_ban_time: float = 60.0,
        missing_grace: float = 3.0,
        busy_time: float = 1.0,
        max_wait: float = 30.0,
        fetch_plans: Callable[[], Awaitable[list[Plan]]] | None = None,
        shape: ModelShape | None = None,
        client_id: str | None = None,
    ) -> None:
        self._fetch, self.model, self.missing_grace = fetch, model, missing_grace
        # plans the peers follow: with the model's shape, a route goes along the group nearest this client
        self._fetch_plans, self.shape, self.client_id = fetch_plans, shape, client_id
        self.plans: list[Plan] = []
        self.refresh_period, self.ban_time, self.max_ban_time = refresh_period, ban_time, max_ban_time
        self.busy_time = busy_time
        self.max_wait = max_wait  # seconds make_chain waits for banned or busy peers before it raises
        self.records: list[PeerRecord] = []
        self.sealed = 0  # records of the last snapshot that could not be read (a private swarm's)
        self._fetched_at = -float("inf")
        self.links = LinkTable(clock=lambda: time.monotonic())  # the client's streams add samples (passive)
        self._bans: dict[str, Ban] = {}
        self._busy: dict[str, tuple[float, str]] = {}  # peer -> (busy until, its refusal)
        self._moved: dict[str, tuple[int, int, float]] = {}  # peer -> the span it left, until when to remember it

    async def refresh(self, force: bool = False) -> list[PeerRecord]:
        if force or time.monotonic() - self._fetched_at > self.refresh_period:
            records = await self._fetch()
            self.sealed = getattr(records, "sealed", 0)
            self.records = self.without_moved(records)
            self.plans = await self._fetch_plans() if self._fetch_plans is not None else []
            self._fetched_at = time.monotonic()
        return self.records

    def on_moved(self, peer_id: str, start: int, end: int, error: BaseException | None = None) -> None:
        """``peer_id`` refused blocks ``[start, end)`` because it serves another span now (``moved:``): not a
        failure, no ban. Its records that still cover that span are stale (the DHT may hold the old one for a
        moment) and are ignored for ``MOVED_MEMORY`` seconds; the next route re-fetches the swarm."""
        self._moved[peer_id] = (start, end, time.monotonic() + MOVED_MEMORY)
        self.records = self.without_moved(self.records)
        self._fetched_at = -float("inf")
        logger.info("Peer %s moved off blocks %d:%d; routing them elsewhere (no ban): %s", short_id(peer_id), start,
                    end, error)

    def without_moved(self, records: list[PeerRecord]) -> list[PeerRecord]:
        """``records`` less the stale ones of peers that refused a span they still claim (``on_moved``)."""
        now = time.monotonic()
        self._moved = {p: m for p, m in self._moved.items() if m[2] > now}
        if not self._moved:
            return records
        kept = [r for r in records if r.peer_id not in self._moved
                or not r.start <= self._moved[r.peer_id][0] < self._moved[r.peer_id][1] <= r.end]
        return _same_kind(records, kept)

    def banned(self) -> set[str]:
        now = time.monotonic()
        return {peer for peer, ban in self._bans.items() if ban.until > now}

    def busy(self) -> set[str]:
        now = time.monotonic()
        return {peer for peer, (until, _) in self._busy.items() if until > now}

    def ban(self, peer_id: str) -> Ban | None:
        """The peer's current or last ban (kept after it ends: the next one doubles), None if none or lifted."""
        return self._bans.get(peer_id)

    def on_failure(self, peer_id: str, error: BaseException | None = None, *, started: float | None = None) -> None:
        """Ban ``peer_id`` for a failure of a request sent at ``started`` (``time.monotonic()``, if known).

        A failure reported while the peer is banned, or of a request sent before its last ban began, is part of
        the failure event that ban is for: it changes nothing. A new failure after a ban ended doubles the
        duration, up to ``max_ban_time``; a success (``on_success``) starts over at ``ban_time``.
        """
        now = time.monotonic()
        last = self._bans.get(peer_id)
        if last is not None and (last.until > now or (started is not None and started <= last.since)):
            logger.debug("Peer %s already banned for this failure event: %s", short_id(peer_id), error)
            return
        duration = min(self.max_ban_time, last.duration * 2 if last else self.ban_time)
        self._bans[peer_id] = Ban(now + duration, duration, now, _describe(error))
        logger.info("Banned peer %s for %.1f s after: %s", short_id(peer_id), duration, error)
        logger.debug("Failure of peer %s", peer_id, exc_info=error)

    def on_busy(self, peer_id: str, error: BaseException | None = None, duration: float | None = None) -> None:
        """``peer_id`` refused for lack of capacity (e.g. its cache is full): route around it for a short while.

        Not a failure: no ban, no backoff.
        """
        duration = self.busy_time if duration is None else duration
        self._busy[peer_id] = (time.monotonic() + duration, _describe(error))
        logger.info("Peer %s is busy; routing around it for %.1f s: %s", short_id(peer_id), duration, error)

    @property
    def rtt(self) -> dict[str, float]:
        """Measured network round trips (seconds, the peer's compute excluded) of the peers we talked to."""
        return self.links.rtts()

    def on_success(self, peer_id: str) -> None:
        """Lift any ban (the request's timing reaches ``links`` from the stream itself)."""
        self._bans.pop(peer_id, None)

    def observe(self, peer_id: str, wall: float, compute: float, nbytes: int) -> None:
        """A reply of ``peer_id``: ``wall`` s from send to reply, ``compute`` s of it on the peer (its report),
        ``nbytes`` both ways; network time = wall - compute goes into ``links`` (``PeerStream``'s observer)."""
        self.links.observe(peer_id, wall, compute, nbytes)

    def unavailable(self, peer_ids: Iterable[str] | None = None) -> list[Unavailable]:
        """Why each of ``peer_ids`` (default: all) is left out now; peers that are not are skipped."""
        now = time.monotonic()
        found = []
        for peer in self._bans.keys() | self._busy.keys() if peer_ids is None else peer_ids:
            ban, (busy_until, refusal) = self._bans.get(peer), self._busy.get(peer, (0.0, ""))
            if ban is not None and ban.until > now and ban.until >= busy_until:
                found.append(Unavailable(peer, "banned", ban.until - now, ban.error))
            elif busy_until > now:
                found.append(Unavailable(peer, "busy", busy_until - now, refusal))
        return found

    def unavailable_error(self, start: int, end: int, refused: dict[str, str]) -> PeersUnavailableError:
        """The error for ``[start, end)`` after the peers in ``refused`` (peer -> refusal) had no room for it,
        for as long as we could wait; peers banned now that serve the span are named too."""
        now, marks = time.monotonic(), {u.peer_id: u for u in self.unavailable()}
        peers = [Unavailable(p, "busy", max(0.0, self._busy.get(p, (now, ""))[0] - now), text)
                 for p, text in refused.items()]
        peers += [marks[r.peer_id] for r in self.records if r.peer_id in marks and r.peer_id not in refused
                  and r.start < end and r.end > start and marks[r.peer_id].state == "banned"]
        return PeersUnavailableError(self.model, start, end, peers)

    def _chain(self, start: int, end: int) -> list[Hop] | None:
        """The best chain avoiding banned and busy peers, or None: along the plans' live group the estimator
        prices fastest for this client (``swarm.plan.route``), else the fastest chain of any online peers."""
        left_out = self.banned() | self.busy()
        if self.plans and self.shape is not None:
            spans = plan_route(self.plans, self.records, self.shape, start, end, client_id=self.client_id,
                               local=self.links, excluded=left_out)
            if spans is not None:
                return [Hop(*span) for span in spans]
        try:
            return make_chain(self.records, start, end, rtt=self.rtt, banned=left_out, model=self.model)
        except MissingBlocksError:
            return None

    def _blockers(self, start: int, end: int) -> tuple[int, int, list[Unavailable]] | None:
        """The blocks of ``[start, end)`` only banned or busy peers serve, and those peers; None if every block
        has a free peer now (a mark expired since the chain was sought: seek it again)."""
        left_out = {u.peer_id: u for u in self.unavailable()}
        online = [r for r in self.records if r.state == PeerState.ONLINE]
        covered = {b for r in online if r.peer_id not in left_out for b in range(r.start, r.end)}
        blocks = [b for b in range(start, end) if b not in covered]
        if not blocks:
            return None
        peers = [left_out[r.peer_id] for r in online if r.peer_id in left_out and r.start <= blocks[-1]
                 and r.end > blocks[0]]
        return blocks[0], blocks[-1] + 1, peers

    def _blockers_at(self, block: int) -> list[Unavailable]:
        """The banned or busy online peers that serve ``block``."""
        left_out = {u.peer_id: u for u in self.unavailable()}
        return [left_out[r.peer_id] for r in self.records
                if r.state == PeerState.ONLINE and r.peer_id in left_out and r.start <= block < r.end]

    async def _wait_for_records(self, start: int, end: int) -> None:
        """Give the swarm ``missing_grace`` seconds to show peers for ``[start, end)`` (banned or not): a peer
        whose heartbeat is late under load drops out of the DHT for a moment. Raises ``MissingBlocksError``, or
        ``PrivateSwarmError`` if the records are there but sealed for members only."""
        for attempt in range(int(self.missing_grace / GRACE_POLL) + 1):
            if attempt:
                await asyncio.sleep(GRACE_POLL)
                await self.refresh(force=True)
            try:
                make_chain(self.records, start, end, rtt=self.rtt, model=self.model)
                return
            except MissingBlocksError as e:
                if attempt == int(self.missing_grace / GRACE_POLL):
                    if self.sealed:
                        raise PrivateSwarmError(self.model, self.sealed) from e
                    raise

    async def make_chain(self, start: int, end: int, *, wait: float | None = None) -> list[Hop]:
        """A chain for ``[start, end)``, avoiding banned and busy peers.

        If the cached snapshot has none, refresh it; if only banned or busy peers could serve the span, wait for
        the earliest of them to be free again (a transient failure of every replica must not fail the request),
        for up to ``wait`` seconds (default ``max_wait``); then ``PeersUnavailableError`` says who and why.
        Nobody serving the span raises ``MissingBlocksError`` (``PrivateSwarmError`` if records are sealed).
        """
        await self.refresh()
        if (chain := self._chain(start, end)) is not None:
            return chain
        await self.refresh(force=True)
        if (chain := self._chain(start, end)) is not None:
            return chain
        await self._wait_for_records(start, end)  # raises if nobody serves the span, banned or not
        deadline = time.monotonic() + (self.max_wait if wait is None else wait)
        retried = False
        while (chain := self._chain(start, end)) is None:
            if (blockers := self._blockers(start, end)) is None and not retried:
                retried = True  # a busy mark or ban expired between the two looks: seek the chain once more
                continue
            first, last, peers = blockers or (start, start + 1, self._blockers_at(start))
            retried = False
            if not peers:  # the snapshot changed: the span lost its peers
                await self._wait_for_records(start, end)
                continue
            now = time.monotonic()
            free_at = now + min(p.seconds_left for p in peers)
            if free_at > deadline:
                raise PeersUnavailableError(self.model, first, last, peers)
            states = " or ".join(sorted({p.state for p in peers}))
            logger.info("Every peer that serves blocks %d:%d is %s; retrying in %.1f s", first, last, states,
                        free_at - now)
            await asyncio.sleep(free_at - now)
            await self.refresh()
        return chain
