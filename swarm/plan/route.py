"""Routing along a plan: of the pipeline groups the peers follow, the one the estimator prices fastest for this
client, its own links to the group's stages included (pure).

A plan only proposes groups: a group counts only while every one of its stages is ONLINE at its planned span in
the client's snapshot (the peers moved) and none is left out (banned or busy), so a plan cannot steer a client to
peers that do not serve what it says. Each group's chain is priced by ``estimate_inference`` (per-token latency:
the stages' compute and the links client -> stage -> client, from the records and the client's own link table).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from swarm.estimator import ModelShape, estimate_inference, estimate_training
from swarm.estimator.from_records import pipeline_from_records
from swarm.estimator.inputs import Topology
from swarm.links import LinkTable
from swarm.plan.types import Group, Plan
from swarm.records import PeerRecord, PeerState

Span = tuple[str, int, int]  # (peer id, start, end)


@dataclass(frozen=True)
class PricedGroup:
    """A group of a plan that is live now, and its estimate for this client."""

    plan: Plan
    group: Group
    seconds: float  # inference: per-token latency; training: seconds per token (1 / tokens/s)

    @property
    def spans(self) -> list[Span]:
        return [(s.peer_id, s.start, s.end) for s in self.group.stages]


def live(group: Group, records: Sequence[PeerRecord], excluded: Iterable[str] = ()) -> bool:
    """Whether every stage of ``group`` is ONLINE at its planned span and not ``excluded``."""
    serving = {r.peer_id: (r.start, r.end) for r in records if r.state == PeerState.ONLINE}
    left_out = set(excluded)
    return all(serving.get(s.peer_id) == s.span and s.peer_id not in left_out for s in group.stages)


def price_groups(plans: Iterable[Plan], records: Sequence[PeerRecord], shape: ModelShape, *,
                 client_id: str | None = None, local: LinkTable | None = None, excluded: Iterable[str] = (),
                 objective: str = "inference", rows: int = 1, seq_len: int = 128,
                 micro_batches: int = 1, topology: Topology = "star", only_live: bool = True) -> list[PricedGroup]:
    """The live groups of ``plans``, fastest first for this client (``objective`` "inference": per-token latency;
    "training": a step of ``micro_batches`` x ``rows`` x ``seq_len`` tokens, one in flight per stage), along the
    data path ``topology`` ("star" or "chain"). ``only_live=False``: also the groups whose peers have not moved yet
    (every peer with a record and none excluded), priced as if they had."""
    excluded = set(excluded)
    known = {r.peer_id for r in records}
    priced = []
    for plan in plans:
        if plan.num_blocks != shape.num_blocks:
            continue
        for group in plan.groups:
            if only_live and not live(group, records, excluded):
                continue
            if any(s.peer_id in excluded or s.peer_id not in known for s in group.stages):
                continue
            pipeline = pipeline_from_records([(s.peer_id, s.start, s.end) for s in group.stages], records,
                                             client_id=client_id, local=local, topology=topology)
            if objective == "training":
                estimate = estimate_training(shape, pipeline, rows=rows, seq_len=seq_len,
                                             micro_batches=micro_batches, in_flight=len(group.stages))
                seconds = 1.0 / estimate.tokens_per_s
            else:
                seconds = estimate_inference(shape, pipeline).token_latency_s
            priced.append(PricedGroup(plan, group, seconds))
    return sorted(priced, key=lambda p: (p.seconds, p.spans))


def choose_group(priced: Sequence[PricedGroup], records: Sequence[PeerRecord], *, excluded: Iterable[str] = (),
                 waited: float, patience: float, tolerance: float = 0.1) -> PricedGroup | None:
    """Of ``priced`` (every group, fastest first: ``price_groups(only_live=False)``), the group to use now: the
    fastest live one if it is within ``tolerance`` of the fastest of all, or once ``waited`` reaches ``patience``
    seconds; None while a clearly faster group is still moving (taking whichever group moved first would train on
    a slow one for the whole run)."""
    excluded = set(excluded)
    ready = [p for p in priced if live(p.group, records, excluded)]
    if not ready:
        return None
    if ready[0].seconds <= priced[0].seconds * (1 + tolerance) or waited >= patience:
        return ready[0]
    return None


def plan_route(plans: Iterable[Plan], records: Sequence[PeerRecord], shape: ModelShape, start: int, end: int, *,
               client_id: str | None = None, local: LinkTable | None = None,
               excluded: Iterable[str] = ()) -> list[Span] | None:
    """Blocks ``[start, end)`` along the plans' live group nearest this client, as (peer, start, end) hops cut
    to the span; None if no plan has a live group."""
    priced = price_groups(plans, records, shape, client_id=client_id, local=local, excluded=excluded)
    if not priced:
        return None
    hops = [(peer, max(a, start), min(b, end)) for peer, a, b in priced[0].spans if a < end and b > start]
    return hops or None
