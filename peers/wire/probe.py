"""The caller's side of an active link probe: a warm-up and a few round trips, then one timed transfer of at most
~1 MiB, over an encrypted ``PeerStream`` (the peer's side and its limits: ``peers.server.probe_calls``)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from peers.wire.messages import LinkProbe
from peers.wire.stream import PeerStream

PROBE_BYTES = 1 << 20  # payload of the timed transfer
PROBE_MAX_BYTES = PROBE_BYTES + (64 << 10)  # what a peer accepts (payload + framing + seal); bigger is refused
PROBE_ROUND_TRIPS = 3


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
