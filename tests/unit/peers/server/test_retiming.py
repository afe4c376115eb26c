"""The idle re-timing of a peer's block (``peers.server.retiming``): when it times, what it adopts."""

from __future__ import annotations

import asyncio

import pytest

from peers.server.retiming import FASTER, IdleClock, Retimer
from peers.wire import traffic
from swarm.measure import Compute

ANNOUNCED = Compute(1e-3, 2e-3)


def _retimer(timings: list[Compute | Exception], idle: list[float], adopted: list[Compute], **kw) -> Retimer:
    async def measure() -> Compute:
        value = timings.pop(0)
        if isinstance(value, Exception):
            raise value
        return value

    return Retimer(ANNOUNCED, measure, adopted.append, lambda: idle[0], **kw)


@pytest.mark.parametrize("scale, adopted", [(0.1, True), (FASTER, True), (0.9, False), (1.0, False), (3.0, False)])
def test_a_timing_is_adopted_only_when_clearly_faster(scale, adopted):
    seen: list[Compute] = []
    timing = Compute(ANNOUNCED.forward * scale, ANNOUNCED.backward * scale)
    retimer = _retimer([timing], [60.0], seen)
    assert asyncio.run(retimer.look()) == (timing if adopted else None)
    assert seen == ([timing] if adopted else [])
    assert retimer.current == (timing if adopted else ANNOUNCED) and retimer.timed == 1


def test_a_busy_peer_is_not_timed():
    seen: list[Compute] = []
    retimer = _retimer([Compute(1e-5, 1e-5)], [5.0], seen, idle_s=30.0)
    assert asyncio.run(retimer.look()) is None
    assert retimer.timed == 0 and seen == []


def test_the_fastest_timing_seen_stays_announced():
    seen: list[Compute] = []
    fast, slower, fastest = Compute(1e-4, 2e-4), Compute(5e-4, 1e-3), Compute(1e-5, 2e-5)
    retimer = _retimer([fast, slower, fastest], [60.0], seen)

    async def three() -> None:
        for _ in range(3):
            await retimer.look()

    asyncio.run(three())
    assert seen == [fast, fastest] and retimer.current == fastest


def test_a_failed_timing_is_skipped_and_the_next_one_counts():
    seen: list[Compute] = []
    fast = Compute(1e-5, 1e-5)
    retimer = _retimer([RuntimeError("CUDA out of memory"), fast], [60.0], seen, every=0.01, idle_s=0.0)

    async def until_adopted() -> None:
        task = asyncio.create_task(retimer.run())
        for _ in range(200):
            await asyncio.sleep(0.01)
            if seen:
                break
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(until_adopted())
    assert seen == [fast]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="every > 0"):
        _retimer([], [0.0], [], every=0)


def test_the_idle_clock_restarts_with_every_stream_byte():
    now = [100.0]
    clock = IdleClock(now=lambda: now[0])
    try:
        now[0] = 130.0
        assert clock.idle_for() == 30.0
        traffic.counted("in", "peer", 10)
        assert clock.idle_for() == 0.0
        now[0] = 131.5
        assert clock.idle_for() == 1.5
    finally:
        clock.close()
    traffic.counted("out", "peer", 10)  # no longer listening
    assert clock.idle_for() == 1.5
