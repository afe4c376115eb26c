"""The caller's side of an active link probe: a warm-up and a few round trips, then one timed transfer of at most
~1 MiB, over an encrypted ``PeerStream`` (the peer's side and its limits: ``peers.server.probe_calls``); and
``probe_into``, probes of several peers one after the other into a ``LinkTable``."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import torch

from peers.wire.messages import LinkProbe
from peers.wire.stream import PeerStream
from privacy.peer_ids import short_id
from swarm.links import LinkTable

logger = logging.getLogger(__name__)

PROBE_BYTES = 1 << 20  # payload of the timed transfer
PROBE_MAX_BYTES = PROBE_BYTES + (64 << 10)  # what a peer accepts (payload + framing + seal); bigger is refused
PROBE_ROUND_TRIPS = 3
PROBE_TIMEOUT = 15.0  # seconds for one whole probe (1 MiB at 1 Mbit/s takes ~8 s)


@dataclass(frozen=True)
class ProbeResult:
    """Network times of the round trips (s), and the transfer: its bytes, wall time and the peer's reported time."""

    round_trips: list[float]
    nbytes: int
    transfer_wall: float
    transfer_compute: float


async def probe_link(stream: PeerStream, *, round_trips: int = PROBE_ROUND_TRIPS, nbytes: int = PROBE_BYTES,
                     timeout: float = 30.0) -> ProbeResult:
    """Probe the link to ``stream``'s peer; ``RequestError`` if the peer refuses (e.g. its rate limit)."""
    await stream.call(LinkProbe(), None, timeout, observe=False)  # unmeasured: a fresh stream's first is slow
    rtts = []
    for _ in range(round_trips):
        began = time.perf_counter()
        reply, _ = await stream.call(LinkProbe(), None, timeout, observe=False)
        wall = time.perf_counter() - began
        rtts.append(wall - min(wall, max(0.0, reply.compute_ms / 1e3)) if reply.compute_ms >= 0 else wall)
    payload = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    began = time.perf_counter()
    reply, _ = await stream.call(LinkProbe(transfer=True), payload, timeout, observe=False)
    wall = time.perf_counter() - began
    return ProbeResult(rtts, payload.numel() * 4, wall, reply.compute_ms / 1e3)


def unmeasured(table: LinkTable, peer_ids: Iterable[str]) -> list[str]:
    """The peers of ``peer_ids`` (in order, once each) whose link ``table`` has no bandwidth estimate for."""
    found: list[str] = []
    for peer_id in peer_ids:
        known = table.get(peer_id)
        if peer_id not in found and (known is None or not known.bandwidth_known):
            found.append(peer_id)
    return found


async def probe_into(table: LinkTable, stream_for: Callable[[str], Awaitable[PeerStream]], peer_ids: Iterable[str],
                     *, timeout: float = PROBE_TIMEOUT, why: str = "its link keeps what was known") -> int:
    """Probe the links to ``peer_ids`` one after the other (parallel probes would share our own uplink and read
    each link slower than it is), into ``table``; how many succeeded. A peer that is gone or refuses (its rate
    limit, an older version) is skipped, saying ``why`` that is fine."""
    done = 0
    for peer_id in peer_ids:
        try:
            stream = await asyncio.wait_for(stream_for(peer_id), timeout)
            result = await asyncio.wait_for(probe_link(stream, timeout=timeout), timeout)
        except Exception as e:
            logger.info("Link probe to %s failed (%s): %s", short_id(peer_id), why, e)
            continue
        table.observe_probe(peer_id, result.round_trips, result.nbytes, result.transfer_wall, result.transfer_compute)
        known = table.get(peer_id)
        if known is not None:
            logger.info("Link to %s: %.3g Mbit/s, round trip %.2f ms (probe)", short_id(peer_id),
                        known.bandwidth / 1e6, known.rtt * 1e3)
        done += 1
    return done
