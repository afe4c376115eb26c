"""The caller's side of an active link probe: a warm-up and a few round trips, then timed transfers over an encrypted
``PeerStream`` (the peer's side and its limits: ``peers.server.probe_calls``); and ``probe_into``, probes of several
peers one after the other into a ``LinkTable``.

The transfers grow with the link: the first carries ``PROBE_BYTES`` (1 MiB); one whose network time is under
``PROBE_LONG_ENOUGH`` (250 ms) is followed by one ``PROBE_GROWTH`` (4) times larger, up to ``PROBE_LARGEST`` (16
MiB), and the last is the reading. On a fast link a 1 MiB transfer is mostly fixed costs (serialization, sealing,
the processes' scheduling: a 1 Gbit/s testbed link read ~350 Mbit/s on a quiet machine, ~50 on a loaded one); the
larger transfers amortise them. The cost is bounded by time, not bytes: a transfer only follows one that was quick,
so it lasts at most ~``PROBE_GROWTH`` x ``PROBE_LONG_ENOUGH`` (1 s) at the rate just read, which a link's true rate
only shortens (an 8 Mbit/s link gets the 1 MiB transfer only, ~1 s; 50 Mbit/s gets 1 and 4 MiB)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import torch

from peers.wire.errors import RequestError
from peers.wire.messages import LinkProbe
from peers.wire.stream import PeerStream
from privacy.peer_ids import short_id
from swarm.links import LinkTable

logger = logging.getLogger(__name__)

PROBE_BYTES = 1 << 20  # payload of the first timed transfer
PROBE_GROWTH = 4  # a transfer shorter than PROBE_LONG_ENOUGH is followed by one this many times larger
PROBE_LARGEST = 16 << 20  # the largest payload a probe sends
PROBE_LONG_ENOUGH = 0.25  # seconds of network time: a transfer this long is the reading
PROBE_MAX_BYTES = PROBE_LARGEST + (64 << 10)  # what a peer accepts (payload + framing + seals); bigger is refused
PROBE_ROUND_TRIPS = 3
PROBE_TIMEOUT = 15.0  # seconds for one whole probe (1 MiB at 1 Mbit/s takes ~8 s)


def next_probe_bytes(nbytes: int, network_time: float, *, growth: int = PROBE_GROWTH, largest: int = PROBE_LARGEST,
                     long_enough: float = PROBE_LONG_ENOUGH) -> int | None:
    """The payload of the transfer that follows one of ``nbytes`` whose network time was ``network_time`` seconds,
    or None when that one is the reading: it lasted ``long_enough`` or more, or was already the ``largest``."""
    if not network_time < long_enough or nbytes >= largest:
        return None
    return min(nbytes * growth, largest)


@dataclass(frozen=True)
class ProbeResult:
    """Network times of the round trips (s), and the transfer: its bytes, wall time and the peer's reported time."""

    round_trips: list[float]
    nbytes: int
    transfer_wall: float
    transfer_compute: float


async def probe_link(stream: PeerStream, *, round_trips: int = PROBE_ROUND_TRIPS, nbytes: int = PROBE_BYTES,
                     largest: int = PROBE_LARGEST, timeout: float = 30.0) -> ProbeResult:
    """Probe the link to ``stream``'s peer: round trips, then transfers from ``nbytes`` growing up to ``largest``
    (``next_probe_bytes``); the result carries the last. ``RequestError`` if the peer refuses the round trips or the
    first transfer (e.g. its rate limit); a later transfer it refuses (an older peer's size cap) ends the probe with
    the reading before it."""
    await stream.call(LinkProbe(), None, timeout, observe=False)  # unmeasured: a fresh stream's first is slow
    rtts = []
    for _ in range(round_trips):
        began = time.perf_counter()
        reply, _ = await stream.call(LinkProbe(), None, timeout, observe=False)
        wall = time.perf_counter() - began
        rtts.append(wall - min(wall, max(0.0, reply.compute_ms / 1e3)) if reply.compute_ms >= 0 else wall)
    result: ProbeResult | None = None
    size: int | None = max(4, nbytes)
    while size is not None:
        payload = torch.zeros(size // 4, dtype=torch.float32)
        began = time.perf_counter()
        try:
            reply, _ = await stream.call(LinkProbe(transfer=True), payload, timeout, observe=False)
        except RequestError:
            if result is None:
                raise
            logger.debug("Link probe to %s: a %d-byte transfer was refused; the smaller one is the reading",
                         short_id(stream.peer_id), size)
            break
        wall = time.perf_counter() - began
        result = ProbeResult(rtts, payload.numel() * 4, wall, reply.compute_ms / 1e3)
        size = next_probe_bytes(result.nbytes, wall - min(wall, max(0.0, result.transfer_compute)), largest=largest)
    assert result is not None
    return result


def unmeasured(table: LinkTable, peer_ids: Iterable[str]) -> list[str]:
    """The peers of ``peer_ids`` (in order, once each) whose link ``table`` has no bandwidth estimate for."""
    found: list[str] = []
    for peer_id in peer_ids:
        known = table.get(peer_id)
        if peer_id not in found and (known is None or not known.bandwidth_known):
            found.append(peer_id)
    return found


async def probe_into(table: LinkTable, stream_for: Callable[[str], Awaitable[PeerStream]], peer_ids: Iterable[str],
                     *, timeout: float = PROBE_TIMEOUT, why: str = "its link keeps what was known",
                     largest: int = PROBE_LARGEST) -> int:
    """Probe the links to ``peer_ids`` one after the other (parallel probes would share our own uplink and read
    each link slower than it is), into ``table``; how many succeeded. A peer that is gone or refuses (its rate
    limit, an older version) is skipped, saying ``why`` that is fine."""
    done = 0
    for peer_id in peer_ids:
        try:
            stream = await asyncio.wait_for(stream_for(peer_id), timeout)
            result = await asyncio.wait_for(probe_link(stream, timeout=timeout, largest=largest), timeout)
        except Exception as e:
            logger.info("Link probe to %s failed (%s): %s", short_id(peer_id), why, e)
            continue
        table.observe_probe(peer_id, result.round_trips, result.nbytes, result.transfer_wall, result.transfer_compute)
        known = table.get(peer_id)
        if known is not None:
            logger.info("Link to %s: %.3g Mbit/s, round trip %.2f ms, %.3g MiB in %.0f ms (probe)", short_id(peer_id),
                        known.bandwidth / 1e6, known.rtt * 1e3, result.nbytes / (1 << 20), result.transfer_wall * 1e3)
        done += 1
    return done
