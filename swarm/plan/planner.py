"""``make_plan``: a snapshot of peers and links in, a ``Plan`` out (pure, deterministic).

Grouping (``grouping``) picks the peers of each pipeline group, ``ordering`` orders and cuts each one; peers no group
uses are the backups. Given the plan in force (``current``), the planner also prices a plan that keeps every
current group still whole (its peers in the same order, its cut re-optimised, spans kept where that costs nothing),
with the other peers grouped afresh, and returns it when it is at least as fast as the fresh plan: peers stay where
they are when moving them buys nothing. Whether to switch at all is ``hysteresis.should_adopt``'s call.
"""

from __future__ import annotations

from collections.abc import Sequence

from swarm.estimator.inputs import ModelShape
from swarm.plan.costs import MESSAGE_TOKENS, CostModel
from swarm.plan.grouping import group_peers
from swarm.plan.linkview import LinkView, as_link_view
from swarm.plan.ordering import order_group
from swarm.plan.partition import Partition, partition
from swarm.plan.types import LinkCost, Plan, PlanPeer

KEEP_SLACK = 1e-9  # relative: a plan that keeps current groups wins ties with a fresh one


def make_plan(peers: Sequence[PlanPeer], num_blocks: int, links: LinkView | LinkCost, *, shape: ModelShape,
              objective: str = "training", model: str, version: int, broker: str = "", now: float = 0.0,
              current: Plan | None = None, message_tokens: int = MESSAGE_TOKENS) -> Plan:
    """The plan for ``peers`` (``PlanPeer``s, unique ids: valid libp2p ids) serving a model of ``num_blocks``
    blocks of ``shape`` for ``objective`` ("training" or "inference"). ``links``: a ``LinkView`` (measured links;
    needed beyond a few hundred peers) or a ``LinkCost`` function ``(a, b) -> (bits/s, rtt s)``. The result has
    ``model``, ``version``, ``broker`` and ``made_at=now`` as given; its groups are sorted fastest first, its
    backups by id. ``current``: the plan in force (see the module). ``message_tokens``: see ``CostModel``."""
    if shape.num_blocks != num_blocks:
        raise ValueError(f"num_blocks {num_blocks} differs from the shape's {shape.num_blocks}")
    if len({p.peer_id for p in peers}) != len(peers):
        raise ValueError("make_plan: a peer appears twice")
    cost = CostModel(shape, objective, message_tokens)
    view = as_link_view(links, [p.peer_id for p in peers])
    rank, prefer = _places(current)
    groups, backups = _fresh(peers, num_blocks, view, cost, rank, prefer)
    if current is not None and current.num_blocks == num_blocks and current.groups:
        kept, kept_backups = _keeping(current, peers, num_blocks, view, cost, rank, prefer)
        if _rate(kept) >= _rate(groups) * (1 - KEEP_SLACK):
            groups, backups = kept, kept_backups
    ordered = sorted(groups, key=lambda g: (g.seconds_per_token, g.spans[0][0].peer_id))
    return Plan(model=model, num_blocks=num_blocks, version=version, groups=tuple(g.group() for g in ordered),
                backups=tuple(sorted(p.peer_id for p in backups)), broker=broker, made_at=now, objective=objective)


def _rate(groups: Sequence[Partition]) -> float:
    return sum(1.0 / g.seconds_per_token for g in groups)


def _places(current: Plan | None) -> tuple[dict[str, tuple], dict[str, int]]:
    """Each peer's place in ``current``: a sort key (group, start) and where its span ends."""
    rank: dict[str, tuple] = {}
    prefer: dict[str, int] = {}
    for g, group in enumerate(current.groups if current is not None else ()):
        for stage in group.stages:
            rank[stage.peer_id] = (g, stage.start)
            prefer[stage.peer_id] = stage.end
    return rank, prefer


def _fresh(peers: Sequence[PlanPeer], num_blocks: int, view: LinkView, cost: CostModel, rank: dict[str, tuple],
           prefer: dict[str, int], taken: frozenset[str] = frozenset()) -> tuple[list[Partition], list[PlanPeer]]:
    grouping = group_peers(peers, num_blocks, view, cost, taken=taken)
    groups: list[Partition] = []
    backups = list(grouping.backups)
    for members in grouping.groups:
        best = order_group(members, num_blocks, view, cost, rank=rank, prefer=prefer)
        if best is None:
            backups.extend(members)
            continue
        groups.append(best)
        backups.extend(best.unused)
    return groups, backups


def _keeping(current: Plan, peers: Sequence[PlanPeer], num_blocks: int, view: LinkView, cost: CostModel,
             rank: dict[str, tuple], prefer: dict[str, int]) -> tuple[list[Partition], list[PlanPeer]]:
    """Every current group whose peers are all still here, in its order (cut anew), then the others grouped around
    them (``group_peers``' ``taken``)."""
    by_id = {p.peer_id: p for p in peers}
    kept: list[Partition] = []
    used: set[str] = set()
    for group in current.groups:
        ids = [s.peer_id for s in group.stages]
        if not all(i in by_id for i in ids):
            continue
        cut = partition([by_id[i] for i in ids], num_blocks, view, cost, prefer=prefer)
        if cut is None:
            continue
        kept.append(cut)
        used.update(p.peer_id for p, _, _ in cut.spans)
    groups, backups = _fresh(peers, num_blocks, view, cost, rank, prefer, frozenset(used))
    return kept + groups, backups
