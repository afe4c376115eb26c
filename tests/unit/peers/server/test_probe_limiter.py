"""ProbeLimiter: a caller gets a few probe round trips and transfers per minute; others are refused with when to
try again, and callers are counted apart."""

from __future__ import annotations

import pytest

import peers.server.probe_calls as probe_calls
from peers.server.probe_calls import WINDOW, ProbeLimiter

A, B = "12D3KooW" + "A" * 44, "12D3KooW" + "B" * 44


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# each step: (seconds to wait first, caller, transfer?, refused?)
@pytest.mark.parametrize(
    "steps",
    [
        [(0, A, True, False), (0, A, True, False), (0, A, True, True)],  # 2 transfers a minute
        [(0, A, True, False), (0, A, True, False), (0, B, True, False), (0, A, False, False)],  # per caller, kind
        [(0, A, True, False), (30, A, True, False), (29, A, True, True), (1.5, A, True, False)],  # a sliding window
        [(0, A, False, False)] * 3 + [(0, A, False, True)],  # 3 round trips (limit set to 3 below)
        [(0, A, False, False)] * 3 + [(WINDOW + 0.1, A, False, False)] * 3,
    ],
)
def test_probe_limits(steps):
    clock = Clock()
    limiter = ProbeLimiter(round_trips=3, transfers=2, clock=clock)
    for wait, caller, transfer, refused in steps:
        clock.now += wait
        refusal = limiter.refusal(caller, transfer)
        assert bool(refusal) == refused, (wait, caller, transfer, refusal)
        if refused:
            kind = "probe transfers" if transfer else "probe round trips"
            assert refusal.startswith(f"probe refused: this peer answers at most {limiter.limits[transfer]} {kind} "
                                      f"per caller per 60 s; try again in ")


def test_a_refused_probe_is_not_counted():
    clock = Clock()
    limiter = ProbeLimiter(round_trips=1, transfers=1, clock=clock)
    assert not limiter.refusal(A, True)
    for _ in range(100):
        clock.now += 0.5
        assert limiter.refusal(A, True)
    clock.now = 1000.0 + WINDOW + 0.01  # one minute after the one answered, whatever was refused since
    assert not limiter.refusal(A, True)


def test_callers_are_bounded(monkeypatch):
    monkeypatch.setattr(probe_calls, "MAX_CALLERS", 4)
    clock = Clock()
    limiter = ProbeLimiter(clock=clock)
    for i in range(50):
        clock.now += 1
        limiter.refusal(f"caller{i}", False)
    assert len(limiter._seen) <= 4
