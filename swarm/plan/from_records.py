"""The planner's input from a DHT snapshot: ``PlanPeer``s from peer records, a ``LinkView`` from their link tables."""

from __future__ import annotations

from collections.abc import Iterable

from swarm.links import DEFAULT_BANDWIDTH, LinkTable
from swarm.plan.linkview import LinkView
from swarm.plan.types import PlanPeer
from swarm.records import PeerRecord, PeerState

PLANNED_STATES = (PeerState.ONLINE, PeerState.JOINING, PeerState.BACKUP)


def plan_peers(records: Iterable[PeerRecord]) -> list[PlanPeer]:
    """A ``PlanPeer`` for each ONLINE, JOINING or BACKUP record (OFFLINE ones are leaving), sorted by peer id:
    its compute per token per block (``seconds_per_block``, ``backward_seconds_per_block``: measured or the
    record's fallbacks) and its memory in blocks (``capacity``). A peer with several records: the one with the
    most capacity, then the fastest."""
    best: dict[str, PlanPeer] = {}
    for record in records:
        if record.state not in PLANNED_STATES:
            continue
        peer = PlanPeer(record.peer_id, record.seconds_per_block, record.backward_seconds_per_block,
                        record.capacity)
        known = best.get(peer.peer_id)
        if known is None or (-peer.max_blocks, peer.forward_s) < (-known.max_blocks, known.forward_s):
            best[peer.peer_id] = peer
    return [best[pid] for pid in sorted(best)]


def link_view_from_records(records: Iterable[PeerRecord], local: LinkTable | None = None,
                           local_id: str | None = None) -> LinkView:
    """Every link the ``records`` carry (a row of ``a``'s record: the link ``a -> row.peer_id``; a row with
    bandwidth 0, only the round trip measured, takes the default bandwidth), and ``local``'s links from
    ``local_id`` (our own table: it wins over our record), as ``swarm.links.link_between`` would answer them."""
    links: dict[tuple[str, str], tuple[float, float]] = {}
    for record in records:
        for row in record.links:
            links[(record.peer_id, row.peer_id)] = (row.bandwidth if row.bandwidth > 0 else DEFAULT_BANDWIDTH,
                                                   row.rtt)
    if local is not None and local_id is not None:
        for peer in sorted(local.links):
            mine = local.get(peer)
            if mine is not None:
                links[(local_id, peer)] = (mine.bandwidth, mine.rtt)
    return LinkView(links)
