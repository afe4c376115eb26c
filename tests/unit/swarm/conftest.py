"""Fixtures of the swarm/ unit tests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from swarm import routing


class FakeClock:
    """A ``time.monotonic`` that moves only when a test sets ``now``."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    """Replace the clock of swarm.routing only (not the global time module)."""
    fake = FakeClock()
    monkeypatch.setattr(routing, "time", SimpleNamespace(monotonic=fake))
    return fake
