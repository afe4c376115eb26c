"""``PeerLinks``: a node's open streams to other peers, one each, opened on first use and reopened once broken.

Clients use it for every call to a stage; peers use it to reach their replicas (averaging, late joiners).
"""

from __future__ import annotations

import asyncio

from hivemind.p2p import P2P

from peers.core.aio import deadline
from peers.wire.stream import LIVENESS_TIMEOUT, Observer, PeerStream
from privacy.admission import Admission


class PeerLinks:
    """Encrypted, admitted streams from this node to others, opened on first use."""

    def __init__(self, p2p: P2P, admission: Admission, *, encrypt: bool = True, timeout: float = 30.0,
                 observe: Observer | None = None, liveness_timeout: float = LIVENESS_TIMEOUT) -> None:
        self.p2p, self.admission, self.encrypt, self.timeout = p2p, admission, encrypt, timeout
        self.liveness_timeout = liveness_timeout  # silence with requests pending that counts as a dead peer
        self.observe = observe  # every stream tells it the timing of its replies (passive link measurement)
        self._streams: dict[str, PeerStream] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def get(self, peer_id: str) -> PeerStream:
        async with self._locks.setdefault(peer_id, asyncio.Lock()):
            stream = self._streams.get(peer_id)
            if stream is None or stream.closed:
                async with deadline(self.timeout):
                    stream = self._streams[peer_id] = await PeerStream.connect(
                        self.p2p, peer_id, encrypt=self.encrypt, timeout=self.timeout, admission=self.admission,
                        observe=self.observe, liveness_timeout=self.liveness_timeout)
            return stream

    def close(self) -> None:
        for stream in self._streams.values():
            stream.shutdown()
        self._streams.clear()
