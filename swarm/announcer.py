"""Heartbeat: re-announce a peer's record every period; each announcement expires after ~two periods."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from hivemind.dht.node import DHTNode

from swarm.discovery import announce
from swarm.records import PeerRecord, PeerState

logger = logging.getLogger(__name__)

STORE_TIMEOUT = 10.0  # seconds for one announcement; independent of the period (a short period is for tests)


class Announcer:
    """Keeps one record alive in the DHT from an asyncio task of the peer's event loop."""

    def __init__(self, node: DHTNode, record: PeerRecord, *, period: float) -> None:
        if period <= 0:
            raise ValueError(f"announce period must be positive, got {period}")
        self.node, self.record, self.period = node, record, period
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()

    @property
    def ttl(self) -> float:
        return 2 * self.period + 1.0

    async def start(self) -> None:
        await self._announce_once()
        self._task = asyncio.create_task(self._loop())

    def update(self, **changes) -> None:
        """Change fields of the record (e.g. ``state=ONLINE``) and announce at once."""
        self.record = dataclasses.replace(self.record, **changes)
        self._wake.set()

    async def stop(self, final_state: PeerState = PeerState.OFFLINE) -> None:
        """Stop the heartbeat and announce ``final_state`` (it expires like any record), so others learn we left."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.record = dataclasses.replace(self.record, state=final_state)
        # the DHT keeps the value that expires last, so the final record must outlive the previous one
        await asyncio.wait_for(announce(self.node, self.record, ttl=self.ttl), timeout=STORE_TIMEOUT)

    async def _loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.period)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            await self._announce_once()

    async def _announce_once(self) -> None:
        try:
            ok = await asyncio.wait_for(announce(self.node, self.record, ttl=self.ttl), timeout=STORE_TIMEOUT)
            if not ok:
                logger.warning("Announcement was not stored by any DHT peer; will retry in %.1f s", self.period)
        except Exception as e:
            logger.warning("Announcement failed (%r); will retry in %.1f s", e, self.period)
