"""Heartbeat: re-announce a peer's record every period; each announcement expires after ~two periods."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

from hivemind.dht.node import DHTNode

from privacy.errors import MembershipError
from swarm.discovery import announce, fetch_records
from swarm.records import PeerRecord, PeerState

logger = logging.getLogger(__name__)

STORE_TIMEOUT = 10.0  # seconds for one announcement; independent of the period (a short period is for tests)


class Announcer:
    """Keeps one record alive in the DHT from an asyncio task of the peer's event loop.

    ``check`` raises ``MembershipError`` when this node may no longer announce (its certificate was revoked or
    expired; see ``swarm.revocations.check_membership``). An announcement that no DHT peer stores is retried,
    unless the node was shut out: its certificate is not valid, or it has none and the swarm is private (the
    model's records are sealed). Then the heartbeat stops with that ``MembershipError`` (``start``/``wait``).
    """

    def __init__(self, node: DHTNode, record: PeerRecord, *, period: float,
                 check: Callable[[], None] | None = None,
                 refresh: Callable[[PeerRecord], PeerRecord] | None = None) -> None:
        if period <= 0:
            raise ValueError(f"announce period must be positive, got {period}")
        self.node, self.record, self.period, self.check = node, record, period, check
        self.refresh = refresh  # brings fields that age (the links' table) up to date before each announcement
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()

    @property
    def ttl(self) -> float:
        return 2 * self.period + 1.0

    async def start(self) -> None:
        """Announce once (``MembershipError`` if this node is shut out of the swarm), then every period."""
        await self._announce_once()
        self._task = asyncio.create_task(self._loop())

    async def wait(self) -> None:
        """Until the heartbeat ends: raises the ``MembershipError`` that stopped it (returns once ``stop``ped)."""
        if self._task is not None:
            try:
                await asyncio.shield(self._task)
            except asyncio.CancelledError:
                if not self._task.cancelled():
                    raise

    def update(self, *, wake: bool = True, **changes) -> None:
        """Change fields of the record (e.g. ``state=ONLINE``) and announce at once (``wake=False``: at the next
        heartbeat)."""
        self.record = dataclasses.replace(self.record, **changes)
        if wake:
            self._wake.set()

    async def publish(self, **changes) -> None:
        """Change fields of the record and store it now, awaited (a peer that moved: clients re-fetch at once)."""
        self.record = dataclasses.replace(self.record, **changes)
        await self._announce_once()

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
        if self.refresh is not None:
            try:
                self.record = self.refresh(self.record)
            except Exception as e:  # a refresh must never stop the heartbeat
                logger.warning("Could not refresh the record (%r); announcing it as it was", e)
        try:
            ok = await asyncio.wait_for(announce(self.node, self.record, ttl=self.ttl), timeout=STORE_TIMEOUT)
        except Exception as e:
            logger.warning("Announcement failed (%r); will retry in %.1f s", e, self.period)
            return
        if not ok:
            await self._raise_if_shut_out()
            logger.warning("Announcement was not stored by any DHT peer; will retry in %.1f s", self.period)

    async def _raise_if_shut_out(self) -> None:
        """``MembershipError`` if the announcement was refused because this node is no member of the swarm."""
        if self.check is not None:
            self.check()  # raises if our certificate was revoked or has expired
        try:  # a member reads its swarm's records: sealed ones mean we are none
            sealed = (await asyncio.wait_for(fetch_records(self.node, self.record.model), STORE_TIMEOUT)).sealed
        except Exception as e:
            logger.debug("Could not look at the swarm's records: %r", e)
            return
        if sealed:
            raise MembershipError(
                f"this swarm is private ({sealed} sealed record(s) under the key of {self.record.model}): its members "
                f"refuse records from a node without a membership certificate. Restart the peer with --private "
                f"CREDENTIALS --identity_path ID, the files of the owner's `swarm invite`")
