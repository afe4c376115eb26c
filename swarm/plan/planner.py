"""``make_plan``: a snapshot of peers and links in, a ``Plan`` out (pure, deterministic).

Grouping (``grouping``) picks the peers of each pipeline group, ``ordering`` orders and cuts each one; peers no
group uses are the backups. Peers a cut leaves out get another grouping round (the groups so far kept) until no new
group forms, so a plan is its own fixpoint: replanning an unchanged swarm with it moves nobody.

Given the plan in force (``current``), the planner also prices a plan that keeps every current group still whole
(its peers in the same order, its cut re-optimised, spans kept where that costs nothing; newcomers may join it),
with the other peers grouped afresh, and returns it unless the fresh plan is faster by more than ``keep_margin``
(5 %): peers stay where they are when moving them buys little (moves cost: blocks reload, sessions replay).
Whether to switch to the result at all is ``hysteresis.should_adopt``'s call.
"""

from __future__ import annotations

from collections.abc import Sequence

from swarm.estimator.inputs import ModelShape
from swarm.plan.costs import MESSAGE_TOKENS, CostModel
from swarm.plan.grouping import LinkGraph, group_peers, link_graph
from swarm.plan.linkview import LinkView, as_link_view
from swarm.plan.ordering import order_group
from swarm.plan.partition import Partition, partition
from swarm.plan.types import LinkCost, Plan, PlanPeer

ROUNDS = 3  # extra groupings of the peers a round left out
KEEP_MARGIN = 0.05  # a fresh plan replaces the current groups only when that much faster (moves cost)


def make_plan(peers: Sequence[PlanPeer], num_blocks: int, links: LinkView | LinkCost, *, shape: ModelShape,
              objective: str = "training", model: str, version: int, broker: str = "", now: float = 0.0,
              current: Plan | None = None, message_tokens: int = MESSAGE_TOKENS, keep_margin: float = KEEP_MARGIN
              ) -> Plan:
    """The plan for ``peers`` (``PlanPeer``s, unique ids: valid libp2p ids) serving a model of ``num_blocks``
    blocks of ``shape`` for ``objective`` ("training" or "inference"). ``links``: a ``LinkView`` (measured links;
    needed beyond a few hundred peers) or a ``LinkCost`` function ``(a, b) -> (bits/s, rtt s)``. The result has
    ``model``, ``version``, ``broker`` and ``made_at=now`` as given; its groups are sorted fastest first, its
    backups by id. ``current``: the plan in force: its groups are kept unless a fresh plan is faster by more than
    ``keep_margin`` (0: only when keeping costs nothing); see the module. ``message_tokens``: see ``CostModel``."""
    if shape.num_blocks != num_blocks:
        raise ValueError(f"num_blocks {num_blocks} differs from the shape's {shape.num_blocks}")
    if len({p.peer_id for p in peers}) != len(peers):
        raise ValueError("make_plan: a peer appears twice")
    cost = CostModel(shape, objective, message_tokens)
    view = as_link_view(links, [p.peer_id for p in peers])
    rank, prefer = _places(current)
    graph = link_graph([p.peer_id for p in peers], view, cost)
    groups, backups = _fresh(peers, num_blocks, view, cost, graph, rank, prefer)
    if current is not None and current.num_blocks == num_blocks and current.groups:
        kept, kept_backups = _keeping(current, peers, num_blocks, view, cost, graph, rank, prefer)
        if _rate(groups) <= _rate(kept) * (1 + keep_margin) * (1 + 1e-12):
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


def _round(peers: Sequence[PlanPeer], num_blocks: int, view: LinkView, cost: CostModel, graph: LinkGraph,
           rank: dict[str, tuple], prefer: dict[str, int], kept: Sequence[Partition], settled: frozenset[str]
           ) -> tuple[list[Partition], list[PlanPeer]]:
    """One grouping: ``kept`` groups first (recut with the newcomers that join them), new groups, backups."""
    grouping = group_peers(peers, num_blocks, view, cost, kept=[[p.peer_id for p in k.peers] for k in kept],
                           settled=settled, graph=graph)
    groups: list[Partition] = []
    backups = list(grouping.backups)
    for cut, joined in zip(kept, grouping.joined, strict=True):
        best = order_group([*cut.peers, *joined], num_blocks, view, cost, rank=rank, prefer=prefer) if joined else cut
        groups.append(best if best is not None and best.seconds_per_token < cut.seconds_per_token else cut)
        backups.extend(joined if groups[-1] is cut else best.unused)
    for members in grouping.groups:
        found = order_group(members, num_blocks, view, cost, rank=rank, prefer=prefer)
        if found is None:
            backups.extend(members)
            continue
        groups.append(found)
        backups.extend(found.unused)
    return groups, backups


def _fresh(peers: Sequence[PlanPeer], num_blocks: int, view: LinkView, cost: CostModel, graph: LinkGraph,
           rank: dict[str, tuple], prefer: dict[str, int], kept: Sequence[Partition] = (),
           settled: frozenset[str] = frozenset()) -> tuple[list[Partition], list[PlanPeer]]:
    """Groups and backups; then, while the peers that groups left out (or could not use) can form new groups among
    themselves, another round with every group so far kept (at most ``ROUNDS``): a plan is its own fixpoint, so
    replanning an unchanged swarm changes nothing."""
    groups, backups = _round(peers, num_blocks, view, cost, graph, rank, prefer, kept, settled)
    everyone = frozenset(p.peer_id for p in peers)
    for _ in range(ROUNDS):
        again, spare = _round(peers, num_blocks, view, cost, graph, rank, prefer, groups, everyone)
        if len(again) == len(groups):
            break
        groups, backups = again, spare
    return groups, backups


def _keeping(current: Plan, peers: Sequence[PlanPeer], num_blocks: int, view: LinkView, cost: CostModel,
             graph: LinkGraph, rank: dict[str, tuple], prefer: dict[str, int]
             ) -> tuple[list[Partition], list[PlanPeer]]:
    """Every current group whose peers are all still here, in its order (cut anew; newcomers may join it), then the
    others grouped around them (``group_peers``' ``kept``)."""
    by_id = {p.peer_id: p for p in peers}
    kept: list[Partition] = []
    for group in current.groups:
        ids = [s.peer_id for s in group.stages]
        if not all(i in by_id for i in ids):
            continue
        cut = partition([by_id[i] for i in ids], num_blocks, view, cost, prefer=prefer)
        if cut is not None:
            kept.append(cut)
    return _fresh(peers, num_blocks, view, cost, graph, rank, prefer, kept, frozenset(current.peers))
