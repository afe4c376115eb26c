"""When each peer was last heard from on any stream of this process (event-loop time), byte by byte.

A peer's reply or heartbeat on one stream waits behind the bytes it sends us on the others (one connection, one
queue per direction): on a slow link busy both ways, a reply can be seconds late while the peer is plainly alive.
Liveness (``peers.wire.stream``) therefore counts silence from the last bytes the peer sent on any stream.
"""

from __future__ import annotations

MAX_PEERS = 4096  # peers remembered at most; the oldest is forgotten first

_heard: dict[str, float] = {}


def heard(peer_id: str, when: float) -> None:
    """Bytes from ``peer_id`` arrived at loop time ``when``."""
    if not peer_id:
        return
    _heard.pop(peer_id, None)  # re-insert: the dict stays in order of last activity
    _heard[peer_id] = when
    if len(_heard) > MAX_PEERS:
        del _heard[next(iter(_heard))]


def last_heard(peer_id: str) -> float:
    """Loop time bytes from ``peer_id`` last arrived on any stream (0.0: never, or forgotten)."""
    return _heard.get(peer_id, 0.0)
