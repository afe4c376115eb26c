"""Timing this peer's block again while it is idle, so that a timing taken on a busy machine is not announced forever.

A peer times one block as it starts (``swarm.measure.cached_compute``) and announces it; the planner and every
router price the peer by that figure. Timed while the machine was busy (other peers starting on the same cores, a
game on the GPU), it stays too slow, cached, for as long as the peer runs. So every ``every`` seconds, once the peer's
streams have moved no byte for ``idle_s`` seconds, it times a block again (one it loads for the purpose from its
model folder: the blocks it serves are never touched) and adopts the new timing when it is at most ``FASTER`` of the
announced one. The fastest timing seen is what the hardware can do; a slower one is not adopted (a busy machine
shows in the link and step times the trainers and clients observe, not in the compute a plan is built on).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from peers.wire import traffic
from swarm.measure import Compute

logger = logging.getLogger(__name__)

RETIME_EVERY = 300.0  # seconds between looks at whether to time the block again (``--retime_every``; 0: never)
IDLE_S = 30.0  # a look times the block only after this many seconds without a stream byte
FASTER = 0.8  # a new timing is adopted when its forward + backward is at most this fraction of the announced one


class IdleClock:
    """Seconds since any stream of this process last moved a byte (``peers.wire.traffic``)."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self.now, self.last = now, now()
        traffic.listen(self._seen)

    def _seen(self, _direction: str, _peer_id: str, _nbytes: int) -> None:
        self.last = self.now()

    def idle_for(self) -> float:
        return self.now() - self.last

    def close(self) -> None:
        traffic.unlisten(self._seen)


class Retimer:
    """Keeps the fastest block timing seen; ``adopt`` is told of each one that improves on the announced figure."""

    def __init__(self, current: Compute, measure: Callable[[], Awaitable[Compute]], adopt: Callable[[Compute], None],
                 idle_for: Callable[[], float], *, every: float = RETIME_EVERY, idle_s: float = IDLE_S) -> None:
        if every <= 0 or idle_s < 0:
            raise ValueError(f"retiming needs every > 0 and idle_s >= 0 seconds, got {every} and {idle_s}")
        self.current, self.measure, self.adopt, self.idle_for = current, measure, adopt, idle_for
        self.every, self.idle_s = every, idle_s
        self.timed = 0  # timings taken (a look while busy takes none)

    def better(self, new: Compute) -> bool:
        return new.forward + new.backward <= FASTER * (self.current.forward + self.current.backward)

    async def look(self) -> Compute | None:
        """One look: time the block if the peer is idle; the new timing if it was adopted, else None."""
        if self.idle_for() < self.idle_s:
            return None
        new = await self.measure()
        self.timed += 1
        if not self.better(new):
            logger.debug("Timed one block again while idle: forward %.3g ms, backward %.3g ms per token (announced: "
                         "%.3g, %.3g): kept", new.forward * 1e3, new.backward * 1e3, self.current.forward * 1e3,
                         self.current.backward * 1e3)
            return None
        logger.info("Timed one block again while idle: forward %.3g ms, backward %.3g ms per token, %.1fx faster than "
                    "announced (it was timed while the machine was busy); announcing it", new.forward * 1e3,
                    new.backward * 1e3, (self.current.forward + self.current.backward) / (new.forward + new.backward))
        self.current = new
        self.adopt(new)
        return new

    async def run(self) -> None:
        """Look every ``every`` seconds until cancelled; a failed timing (e.g. out of memory) is logged and skipped."""
        while True:
            await asyncio.sleep(self.every)
            try:
                await self.look()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the peer serves on with the figure it has
                logger.warning("Could not time one block again (%s: %s); keeping the announced compute",
                               type(e).__name__, e)


def start_retiming(server, compute: Compute, key: str) -> asyncio.Task | None:
    """The retiming task of a ``StageServer`` that timed its block as ``compute`` (cached under ``key``); None if
    ``--retime_every`` is 0. Cancel it to stop."""
    from peers.server.block_timing import measure_loaded_block
    from swarm.measure import store_compute

    config = server.config
    if config.retime_every <= 0:
        return None

    async def measure() -> Compute:
        return await asyncio.to_thread(measure_loaded_block, config.model_dir, server.model_config.hidden_size,
                                       server.device, server.dtype)

    def adopt(new: Compute) -> None:
        server.throughput = 1.0 / new.forward
        store_compute(config.cache_dir, key, new)
        server.announcer.update(throughput=server.throughput, forward_seconds=new.forward,
                                backward_seconds=new.backward)

    async def run() -> None:
        clock = IdleClock()
        try:
            await Retimer(compute, measure, adopt, clock.idle_for, every=config.retime_every,
                          idle_s=min(IDLE_S, config.retime_every)).run()
        finally:
            clock.close()

    return asyncio.create_task(run())
