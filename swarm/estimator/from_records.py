"""Estimator inputs from what the swarm publishes: a peer's record gives its ``Compute``, the link tables its
``Link``s, so a planner can price a candidate pipeline of real peers without measuring anything itself."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from swarm.estimator.inputs import CLIENT, Compute, Link, Pipeline, Stage, Topology
from swarm.links import LinkTable, link_between
from swarm.records import PeerRecord


def compute_of(record: PeerRecord) -> Compute:
    """A peer's measured compute per token per block (the record's fallbacks when it measured nothing)."""
    return Compute(forward_s=record.seconds_per_block, backward_s=record.backward_seconds_per_block)


def link_of(a: str, b: str, records: Iterable[PeerRecord], local: LinkTable | None = None,
            local_id: str | None = None) -> Link:
    """The best-known link ``a -> b`` (measured, or the conservative defaults of ``swarm.links``)."""
    known = link_between(a, b, records, local, local_id)
    return Link.from_rtt(known.bandwidth, known.rtt)


def pipeline_from_records(spans: Sequence[tuple[str, int, int]], records: Sequence[PeerRecord], *,
                          client_id: str | None = None, local: LinkTable | None = None,
                          topology: Topology = "star") -> Pipeline:
    """The pipeline of ``spans`` (peer id, start, end), priced from ``records`` and the caller's own link table.

    ``client_id`` is the client's (or trainer's) peer id when it has one: its own ``local`` table then gives the
    client's links; otherwise they are the peers' rows for it, else the defaults. Raises ``KeyError`` naming a
    peer that has no record.
    """
    by_peer = {r.peer_id: r for r in records}
    missing = [peer for peer, _, _ in spans if peer not in by_peer]
    if missing:
        raise KeyError(f"no record for peer(s) {', '.join(missing)}: refresh the snapshot of the swarm")
    stages = tuple(Stage(peer, start, end, compute_of(by_peer[peer])) for peer, start, end in spans)
    me = client_id or CLIENT
    links: dict[tuple[str, str], Link] = {}
    for stage in stages:
        links[(CLIENT, stage.peer)] = link_of(me, stage.peer, records, local, client_id)
        links[(stage.peer, CLIENT)] = link_of(stage.peer, me, records, local, client_id)
    for first, second in zip(stages, stages[1:], strict=False):
        links[(first.peer, second.peer)] = link_of(first.peer, second.peer, records, local, client_id)
        links[(second.peer, first.peer)] = link_of(second.peer, first.peer, records, local, client_id)
    return Pipeline(stages, links, topology=topology)
