"""What a broker does with a snapshot (pure): make the plan for it, and decide whether it replaces the plan in force.

Three callers: a trainer for its own run (``SwarmTrainer(plan=True)``), the private swarm's elected broker for the
swarm-wide inference plan, and, in a public swarm, each peer for itself (it moves only itself). All three go
through :func:`next_plan`: the planner's candidate replaces the plan in force only if ``should_adopt`` says it is
clearly better (hysteresis) or the plan in force no longer works; a replacement gets the next version.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from swarm.estimator import ModelShape
from swarm.links import LinkTable
from swarm.plan.from_records import link_view_from_records, plan_peers
from swarm.plan.hysteresis import should_adopt
from swarm.plan.planner import make_plan
from swarm.plan.types import Plan
from swarm.records import PeerRecord


def plan_for(records: Sequence[PeerRecord], *, shape: ModelShape, model: str, objective: str, version: int,
             broker: str, now: float, run_id: str = "", current: Plan | None = None,
             local: LinkTable | None = None, local_id: str | None = None, excluded: Iterable[str] = ()) -> Plan:
    """The planner's plan for the peers of ``records`` (less ``excluded``: e.g. peers banned after a failure),
    priced with their link tables and the caller's own (``local`` from ``local_id``)."""
    left_out = set(excluded)
    peers = [p for p in plan_peers(records) if p.peer_id not in left_out]
    view = link_view_from_records([r for r in records if r.peer_id not in left_out], local, local_id)
    plan = make_plan(peers, shape.num_blocks, view, shape=shape, objective=objective, model=model, version=version,
                     broker=broker, now=now, current=current)
    return dataclasses.replace(plan, run_id=run_id)


def next_plan(records: Sequence[PeerRecord], current: Plan | None, *, shape: ModelShape, model: str,
              objective: str, broker: str, now: float, first_version: int = 0, run_id: str = "",
              local: LinkTable | None = None, local_id: str | None = None,
              excluded: Iterable[str] = ()) -> Plan:
    """The plan to publish now: ``current`` (kept, made_at refreshed) unless the planner's candidate should replace
    it; a replacement has version ``current.version + 1`` (``first_version`` when there is none). A ``current``
    that names an ``excluded`` peer in a group no longer works and is always replaced."""
    left_out = set(excluded)
    version = first_version if current is None else max(first_version, current.version + 1)
    candidate = plan_for(records, shape=shape, model=model, objective=objective, version=version, broker=broker,
                         now=now, run_id=run_id, current=current, local=local, local_id=local_id, excluded=left_out)
    if current is None or not candidate.groups:
        return candidate if current is None else dataclasses.replace(current, made_at=now)
    broken = any(s.peer_id in left_out for g in current.groups for s in g.stages)
    peers = [p for p in plan_peers(records) if p.peer_id not in left_out]
    view = link_view_from_records(records, local, local_id)
    if broken or should_adopt(current, candidate, peers, view, shape=shape):
        return candidate
    return dataclasses.replace(current, made_at=now)
