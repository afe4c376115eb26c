"""Fixtures for the privacy tests: a swarm owner, members, and a controllable clock."""

from __future__ import annotations

import time

import pytest

from privacy.identity import Identity
from privacy.membership import MembershipVerifier, SwarmOwner


class FakeClock:
    def __init__(self, now: float | None = None):
        self.now = time.time() if now is None else now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def owner() -> SwarmOwner:
    return SwarmOwner.generate()


@pytest.fixture
def member() -> Identity:
    return Identity.generate()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def verifier(owner, clock) -> MembershipVerifier:
    return MembershipVerifier(owner.public_info(), clock=clock)
