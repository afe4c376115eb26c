"""The simulation's event loop runs actions in time order, ties in scheduling order, never into the past."""

from __future__ import annotations

import pytest

from swarm.simulation.events import EventLoop


def test_actions_run_in_time_order_and_ties_in_scheduling_order():
    loop, seen = EventLoop(), []
    for when, name in ((5.0, "c"), (1.0, "a"), (5.0, "d"), (3.0, "b")):
        loop.at(when, lambda name=name: seen.append((loop.now, name)))
    assert loop.run(10.0) == 4
    assert seen == [(1.0, "a"), (3.0, "b"), (5.0, "c"), (5.0, "d")]
    assert loop.now == 10.0


def test_an_action_may_schedule_more_and_run_stops_at_until():
    loop, seen = EventLoop(), []

    def tick() -> None:
        seen.append(loop.now)
        loop.after(2.0, tick)

    loop.at(0.0, tick)
    loop.run(7.0)
    assert seen == [0.0, 2.0, 4.0, 6.0]
    assert len(loop) == 1  # the one at 8 s waits


def test_scheduling_in_the_past_is_refused():
    loop = EventLoop()
    loop.run(5.0)
    with pytest.raises(ValueError, match="cannot schedule"):
        loop.at(4.0, lambda: None)
    with pytest.raises(ValueError, match="cannot schedule"):
        loop.at(float("nan"), lambda: None)
