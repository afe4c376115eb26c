"""Bytes of this process's streams, per neighbour and direction, told to whoever listens (a peer's metrics,
``peers.server.metrics``); nobody by default, at the cost of one check per frame."""

from __future__ import annotations

from collections.abc import Callable

Sink = Callable[[str, str, int], None]  # (direction "in" | "out", peer id, bytes)

_sinks: list[Sink] = []


def listen(sink: Sink) -> None:
    if sink not in _sinks:
        _sinks.append(sink)


def unlisten(sink: Sink) -> None:
    if sink in _sinks:
        _sinks.remove(sink)


def counted(direction: str, peer_id: str, nbytes: int) -> None:
    for sink in _sinks:
        sink(direction, peer_id, nbytes)
