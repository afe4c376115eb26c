"""What a node knows of its links to other peers: round trip and bandwidth, measured on real traffic (passive) or by
a rare bounded probe (active), kept as outlier-resistant EMAs per neighbour.

Every reply of a peer says how long the peer itself spent on the request (``compute``: from the request read to
the reply built, queueing included). What is left of the caller's wall time is network time: a round trip for a
small message, a round trip plus the transfer for a large one. ``LinkTable`` turns those samples into estimates;
``best_rows`` is what a peer publishes in its record (``swarm.records.LinkRow``); ``link_between`` answers "what
do we know of the link a -> b" from records and our own table, with conservative defaults for unknown links.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from swarm.records import MAX_AGE, MAX_BANDWIDTH, MAX_LINKS, MAX_RTT, LinkRow, PeerRecord

SMALL_BYTES = 32 << 10  # a request + reply below this is a round-trip sample (its transfer time is negligible)
LARGE_BYTES = 256 << 10  # at or above this, a bandwidth sample: bytes / (network time - round trip)
MIN_TRANSFER = 1e-4  # seconds: a transfer time below this says nothing about bandwidth (clock resolution)
ALPHA = 0.2  # EMA weight of a new sample
CLIP = 2.0  # a sample is clipped into [median / CLIP, median * CLIP] of the recent samples before it is averaged
WINDOW = 7  # recent samples the clip's median is taken over
MAX_NEIGHBOURS = 256  # a table forgets its oldest neighbours beyond this
PROBE_TRUST_AGE = 600.0  # seconds a probe's bandwidth reading counts as the link's capacity (``LinkEstimate.capacity``)

# Conservative defaults for a link nobody has measured yet (a newcomer is usable at once, but measured links win):
DEFAULT_RTT = 0.05  # seconds: a wide-area round trip (loopback is ~0.5 ms, a continent ~20-80 ms)
DEFAULT_BANDWIDTH = 10e6  # bits/s: a home uplink (FusionLLM's slowest links are 8 Mbit/s)

SOURCES = ("passive", "probe")  # how a measured link was learned; "default" when nothing is known


class RobustEma:
    """The median of the first ``WINDOW`` samples, then an EMA (``ALPHA``) of samples each first clipped into
    ``[m / CLIP, m * CLIP]``, where ``m`` is the median of the last ``WINDOW`` samples (this one included). So one
    outlier, even the first sample (a fresh connection's first round trip), moves the estimate by at most
    ``ALPHA * (CLIP - 1)`` of it, while a real change of the link moves the median within about ``WINDOW / 2``
    samples and is then followed.
    """

    def __init__(self) -> None:
        self.value: float | None = None
        self.samples = 0
        self._recent: deque[float] = deque(maxlen=WINDOW)

    def add(self, sample: float) -> float:
        self._recent.append(sample)
        self.samples += 1
        ordered = sorted(self._recent)
        middle = len(ordered) // 2
        if self.value is None or self.samples <= WINDOW:
            self.value = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
            return self.value
        median = ordered[middle]
        clipped = min(max(sample, median / CLIP), median * CLIP)
        self.value = (1 - ALPHA) * self.value + ALPHA * clipped
        return self.value


def network_time(wall: float, compute: float) -> float | None:
    """``wall - compute`` for a reply whose peer reported ``compute`` seconds on it; None if either is not a finite
    number >= 0 (the sample is dropped). A peer's report is never trusted beyond the wall time we saw."""
    if not (_finite(wall) and _finite(compute)) or wall < 0 or compute < 0:
        return None
    return wall - min(compute, wall)


@dataclass
class LinkState:
    """One neighbour's estimates (``rtt`` in seconds, ``bandwidth`` in bits/s) and when they last changed."""

    rtt: RobustEma = field(default_factory=RobustEma)
    bandwidth: RobustEma = field(default_factory=RobustEma)
    updated: float = 0.0  # ``clock()`` of the last sample
    source: str = "passive"  # of the last sample
    recent: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=16))  # (wall, compute) seen
    probed: float = 0.0  # bits/s the last probe transfer read (0: none)
    probed_at: float = -math.inf  # ``clock()`` of that probe


@dataclass(frozen=True)
class LinkEstimate:
    """What is known of one directed link: bandwidth (bits/s), round trip (s), age (s since measured) and where it
    comes from: "passive" (real traffic), "probe" (an active probe) or "default" (nothing known: conservative
    ``DEFAULT_RTT`` / ``DEFAULT_BANDWIDTH``). ``bandwidth_known`` is False when only the round trip was measured
    (the bandwidth is then the default); ``reverse`` when only b -> a was measured and taken for a -> b."""

    bandwidth: float
    rtt: float
    age: float
    source: str
    bandwidth_known: bool = True
    reverse: bool = False
    probed: float = 0.0  # bits/s a probe read within ``PROBE_TRUST_AGE`` (0: none)

    @property
    def capacity(self) -> float:
        """The bits/s a transfer can expect: the larger of the estimate and a recent probe's reading. A passive
        sample can only under-read a link (its reply may wait behind the other direction's traffic, as on a link
        busy both ways), never over-read it, so a probe of the idle link is the better guide to what a send takes."""
        return max(self.bandwidth, self.probed)

    def transfer_time(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` over this link, one way: half a round trip plus the bytes at its bandwidth."""
        return self.rtt / 2 + 8 * nbytes / self.bandwidth


DEFAULT_LINK = LinkEstimate(DEFAULT_BANDWIDTH, DEFAULT_RTT, math.inf, "default", bandwidth_known=False)


class LinkTable:
    """This node's links to its neighbours, from samples of its own traffic and probes."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.links: dict[str, LinkState] = {}

    def observe(self, peer_id: str, wall: float, compute: float, nbytes: int, *, source: str = "passive") -> bool:
        """One request to ``peer_id``: ``wall`` seconds from send to reply, of which the peer reported ``compute``,
        ``nbytes`` both ways. True if it made a sample (invalid figures and mid-sized messages make none)."""
        network = network_time(wall, compute)
        if network is None or not isinstance(nbytes, int) or nbytes < 0:
            return False
        if nbytes < SMALL_BYTES:
            state = self._state(peer_id)
            state.rtt.add(network)
        elif nbytes >= LARGE_BYTES:
            known = self.links.get(peer_id)
            rtt = known.rtt.value if known is not None and known.rtt.value is not None else 0.0
            transfer = network - rtt
            if transfer < MIN_TRANSFER:
                return False
            state = self._state(peer_id)
            state.bandwidth.add(8 * nbytes / transfer)
            if source == "probe":
                state.probed, state.probed_at = 8 * nbytes / transfer, self.clock()
        else:
            return False
        state.updated, state.source = self.clock(), source
        state.recent.append((wall, min(compute, wall)))
        return True

    def observe_probe(self, peer_id: str, round_trips: Iterable[float], nbytes: int, transfer_wall: float,
                      transfer_compute: float = 0.0) -> None:
        """An active probe: a few round trips of tiny messages (their network times), then one timed transfer of
        ``nbytes`` (its wall time and the peer's reported time on it)."""
        for rtt in round_trips:
            self.observe(peer_id, rtt, 0.0, 0, source="probe")
        self.observe(peer_id, transfer_wall, transfer_compute, max(nbytes, LARGE_BYTES), source="probe")

    def get(self, peer_id: str) -> LinkEstimate | None:
        """What we measured of the link to ``peer_id`` (a missing figure is the default), or None."""
        state = self.links.get(peer_id)
        if state is None:
            return None
        rtt, bandwidth = state.rtt.value, state.bandwidth.value
        recent = self.clock() - state.probed_at <= PROBE_TRUST_AGE
        return LinkEstimate(bandwidth if bandwidth is not None else DEFAULT_BANDWIDTH,
                            rtt if rtt is not None else DEFAULT_RTT, max(0.0, self.clock() - state.updated),
                            state.source, bandwidth_known=bandwidth is not None,
                            probed=state.probed if recent else 0.0)

    def rtts(self) -> dict[str, float]:
        """Measured network round trips per neighbour (what the router adds per hop)."""
        return {peer: state.rtt.value for peer, state in self.links.items() if state.rtt.value is not None}

    def best_rows(self, limit: int = MAX_LINKS) -> tuple[LinkRow, ...]:
        """The ``limit`` links we know best (the most recently measured, then the most sampled) as record rows;
        bandwidth 0 where only the round trip is known."""
        now = self.clock()
        ranked = sorted(self.links.items(), key=lambda kv: (-kv[1].updated, -(kv[1].rtt.samples
                                                                               + kv[1].bandwidth.samples), kv[0]))
        rows = []
        for peer, state in ranked[:limit]:
            rows.append(LinkRow(peer_id=peer, bandwidth=_bounded(state.bandwidth.value, 0.0, MAX_BANDWIDTH),
                                rtt=_bounded(state.rtt.value, DEFAULT_RTT, MAX_RTT),
                                age=_bounded(now - state.updated, 0.0, MAX_AGE), source=state.source))
        return tuple(rows)

    def _state(self, peer_id: str) -> LinkState:
        state = self.links.get(peer_id)
        if state is None:
            if len(self.links) >= MAX_NEIGHBOURS:
                del self.links[min(self.links, key=lambda p: self.links[p].updated)]
            state = self.links[peer_id] = LinkState()
        return state


def link_between(a: str, b: str, records: Iterable[PeerRecord], local: LinkTable | None = None,
                 local_id: str | None = None) -> LinkEstimate:
    """What we know of the link ``a -> b``: our own table if ``a`` is us (``local_id``), else the row for ``b`` in
    ``a``'s record, else (taken as symmetric, ``reverse=True``) the row for ``a`` in ``b``'s record or our table's
    entry for ``a`` if ``b`` is us; else ``DEFAULT_LINK``. A record row's age is as of its announcement.

    A link taken as symmetric is no faster than the fastest link ``a`` measured sending to anyone (``sender_cap``):
    home lines upload far slower than they download, and ``a``'s upload carries every link out of it, so a peer
    whose probes to everyone read 10 Mbit/s is not priced at the 50 Mbit/s we measured sending to it."""
    if local is not None and local_id is not None and a == local_id and (mine := local.get(b)) is not None:
        return mine
    by_peer = {r.peer_id: r for r in records}
    if (row := _row(by_peer.get(a), b)) is not None:
        return _from_row(row, reverse=False)
    if local is not None and local_id is not None and b == local_id and (mine := local.get(a)) is not None:
        return _capped(LinkEstimate(mine.bandwidth, mine.rtt, mine.age, mine.source, mine.bandwidth_known,
                                    reverse=True, probed=mine.probed), sender_cap(by_peer.get(a)))
    if (row := _row(by_peer.get(b), a)) is not None:
        return _capped(_from_row(row, reverse=True), sender_cap(by_peer.get(a)))
    return DEFAULT_LINK


def sender_cap(record: PeerRecord | None) -> float | None:
    """The fastest bandwidth ``record``'s peer measured on a link out of it (bits/s), None if it measured none."""
    rates = [row.bandwidth for row in record.links if row.bandwidth > 0] if record is not None else []
    return max(rates) if rates else None


def _capped(known: LinkEstimate, cap: float | None) -> LinkEstimate:
    if cap is None or not known.bandwidth_known or known.bandwidth <= cap:
        return known
    return replace(known, bandwidth=cap, probed=min(known.probed, cap))


def _row(record: PeerRecord | None, neighbour: str) -> LinkRow | None:
    if record is None:
        return None
    return next((row for row in record.links if row.peer_id == neighbour), None)


def _from_row(row: LinkRow, *, reverse: bool) -> LinkEstimate:
    known = row.bandwidth > 0
    return LinkEstimate(row.bandwidth if known else DEFAULT_BANDWIDTH, row.rtt, row.age, row.source,
                        bandwidth_known=known, reverse=reverse)


def _bounded(value: float | None, default: float, most: float) -> float:
    """``value`` within the record's bounds ``[0, most]`` (``default`` if unknown)."""
    return default if value is None or not _finite(value) else min(max(0.0, value), most)


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
