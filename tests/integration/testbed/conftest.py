"""Testbed tests need root and iproute2 (CI here has both); elsewhere they skip, saying why."""

from __future__ import annotations

import pytest

from swarm.testbed import require_nft, require_root


@pytest.fixture(autouse=True)
def _needs_root() -> None:
    reason = require_root()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def needs_nft() -> None:
    reason = require_nft()
    if reason:
        pytest.skip(reason)
