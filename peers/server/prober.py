"""``LinkProber``: a peer measures its links to the other peers of its model and publishes the best in its record.

Passive samples come from its own streams (replica traffic; ``PeerLinks(observe=...)``); a peer it has no estimate
for (or whose estimate is older than ``REPROBE_AGE``) gets an active probe (``peers.wire.probe``): when this peer
joins, then at most once per ``period`` per neighbour. Probes are sequential, a few per round.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable

from peers.wire.probe import PROBE_LARGEST, probe_into
from peers.wire.stream import PeerStream
from swarm.links import LinkTable
from swarm.records import LinkRow, PeerRecord, PeerState

logger = logging.getLogger(__name__)

PROBE_PERIOD = 60.0  # seconds between rounds (jittered)
REPROBE_AGE = 600.0  # seconds: an estimate older than this is probed again
MAX_PROBES_PER_ROUND = 8
PROBE_TIMEOUT = 15.0  # seconds for one whole probe


class LinkProber:
    """Probes the neighbours ``fetch`` lists that ``table`` knows nothing (recent) of, and calls ``publish`` with
    the table's best rows after each round."""

    def __init__(self, table: LinkTable, stream_for: Callable[[str], Awaitable[PeerStream]],
                 fetch: Callable[[], Awaitable[list[PeerRecord]]], own_id: str,
                 publish: Callable[[tuple[LinkRow, ...], bool], None], *, period: float = PROBE_PERIOD,
                 largest: int = PROBE_LARGEST) -> None:
        self.table, self.stream_for, self.fetch, self.own_id = table, stream_for, fetch, own_id
        self.publish, self.period, self.largest = publish, period, largest
        self.probed = 0  # probes that succeeded (for tests and logs)

    def targets(self, records: list[PeerRecord]) -> list[str]:
        """Online peers of the model, not us, without a recent estimate with a bandwidth: the ones to probe."""
        found = []
        for record in records:
            if record.peer_id == self.own_id or record.state != PeerState.ONLINE:
                continue
            known = self.table.get(record.peer_id)
            if known is None or not known.bandwidth_known or known.age > REPROBE_AGE:
                found.append(record.peer_id)
        return found[:MAX_PROBES_PER_ROUND]

    async def round(self) -> int:
        """One round: probe the targets one by one, then publish; returns how many probes succeeded."""
        try:
            records = await self.fetch()
        except Exception as e:
            logger.debug("Link probes: could not fetch the swarm's records: %r", e)
            return 0
        done = await probe_into(self.table, self.stream_for, self.targets(records), timeout=PROBE_TIMEOUT,
                                why="tried again next round", largest=self.largest)
        self.probed += done
        self.publish(self.table.best_rows(), done > 0)
        return done

    async def run(self) -> None:
        """Rounds forever: the first at once (a joining peer), then every ``period`` seconds (jittered)."""
        while True:
            await self.round()
            await asyncio.sleep(self.period * random.uniform(0.8, 1.2))
