"""Shared by the CLI's unit tests: ``swarm generate`` without a swarm."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest


class _NoSwarm:
    """Stands for ``SwarmClient``: a context manager that connects to nothing."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __enter__(self) -> _NoSwarm:
        return self

    def __exit__(self, *exc) -> None:
        return None


@pytest.fixture
def fake_generation(monkeypatch) -> Callable[[Callable[..., Iterator[str]]], None]:
    """Call it with a ``stream_text`` stand-in: ``swarm generate`` then streams what that yields, with no swarm."""
    import peers.client.swarm_client
    import peers.client.textgen

    def install(stream_text: Callable[..., Iterator[str]]) -> None:
        monkeypatch.setattr(peers.client.swarm_client, "SwarmClient", _NoSwarm)
        monkeypatch.setattr(peers.client.textgen, "stream_text", stream_text)

    return install
