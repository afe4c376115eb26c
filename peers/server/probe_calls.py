"""The peer's side of active link probes (``peers.wire.probe``): answer at once, within a per-caller rate limit and a
size cap. A refused probe is one log line and an error reply; the stream and the peer go on serving."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

from hivemind.proto import runtime_pb2

from peers.core.aio import deadline
from peers.server.calls import Call, Responses, StreamCalls, elapsed_ms, reply
from peers.wire.errors import RequestError
from peers.wire.messages import InferenceReply, LinkProbe
from peers.wire.probe import PROBE_MAX_BYTES
from peers.wire.tensors import read_tensor_messages
from privacy.peer_ids import short_id

logger = logging.getLogger(__name__)

WINDOW = 60.0  # seconds the limits count over
MAX_ROUND_TRIPS = 12  # per caller per window: a probe makes 4 (a warm-up and 3); so a few probes a minute
MAX_TRANSFERS = 6  # per caller per window: a probe has 1 to 3 (1, 4, 16 MiB; peers.wire.probe)
MAX_CALLERS = 4096  # callers remembered; the oldest are forgotten beyond this


class ProbeLimiter:
    """Round trips and transfers a caller may still probe in the last ``WINDOW`` seconds."""

    def __init__(self, *, round_trips: int = MAX_ROUND_TRIPS, transfers: int = MAX_TRANSFERS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = {False: round_trips, True: transfers}
        self.clock = clock
        self._seen: dict[tuple[str, bool], deque[float]] = {}

    def refusal(self, caller: str, transfer: bool) -> str:
        """Why this probe is refused ("" if allowed: it is then counted)."""
        now, limit = self.clock(), self.limits[transfer]
        times = self._seen.get((caller, transfer))
        if times is None:
            if len(self._seen) >= MAX_CALLERS:
                del self._seen[min(self._seen, key=lambda k: self._seen[k][-1] if self._seen[k] else 0.0)]
            times = self._seen[caller, transfer] = deque()
        while times and times[0] <= now - WINDOW:
            times.popleft()
        if len(times) >= limit:
            kind = "probe transfers" if transfer else "probe round trips"
            return (f"probe refused: this peer answers at most {limit} {kind} per caller per {WINDOW:.0f} s; "
                    f"try again in {times[0] + WINDOW - now:.0f} s")
        times.append(now)
        return ""


class ProbeCalls(StreamCalls):
    """Answers ``LinkProbe`` requests: a round trip at once, a transfer once its payload (<= ``PROBE_MAX_BYTES``)
    is read; the reply's ``compute_ms`` is this peer's time on it."""

    def __init__(self, limiter: ProbeLimiter, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.limiter = limiter

    async def probe(self, request: LinkProbe, call: Call) -> Responses:
        if bool(call.message.tensors) != request.transfer:
            await self.skip_tensor(call)
            return [reply(error="probe refused: a transfer probe carries a tensor, a round trip none")]
        if refusal := self.limiter.refusal(call.caller, request.transfer):
            await self.skip_tensor(call)
            logger.info("Refused a probe from %s: %s", short_id(call.caller), refusal)
            return [reply(error=refusal)]
        if request.transfer:
            try:
                async with deadline(self.request_timeout):
                    await read_tensor_messages(call.requests, PROBE_MAX_BYTES, first=call.message,
                                               unseal=call.stream.unseal)
            except (RequestError, ValueError, asyncio.TimeoutError) as e:
                error = f"probe refused: a probe transfer may carry at most {PROBE_MAX_BYTES} bytes ({e or 'timeout'})"
                logger.info("Refused a probe from %s: %s", short_id(call.caller), error)
                return [reply(error=error)]
        started = time.perf_counter()
        return [runtime_pb2.ExpertResponse(metadata=InferenceReply(compute_ms=elapsed_ms(started)).to_bytes())]
