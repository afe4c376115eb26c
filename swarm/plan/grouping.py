"""Which peers form a pipeline group: sites of fast links first, each split into as many groups as its peers make.

1. **Tiers.** Each measured link gets its per-token hop cost (``CostModel.hop_s``, the slower direction). Sorted,
   the costs fall into tiers: a new tier starts at a gap (a cost over ``GAP`` x the previous) or when the tier
   would span over ``WIDTH`` x its first cost. Sites of 10 Gbit/s, 100 Mbit/s and 8 Mbit/s links fall apart.
2. **Sites.** From the fastest tier up, the peers still unplaced are joined along the links of this tier or faster
   (connected components). A component whose memory can hold the model is split into groups (3); its peers left
   over join those groups or stay spares (4). A component that cannot hold the
   model waits: at the next tier it may join others (groups straddle a slow link only when no faster site can hold
   the model). Last, peers with no measured link that helps are grouped over unmeasured links (their defaults).
3. **Groups as paths.** A group grows as a path along measured links of its tier (a pipeline uses only the links
   between neighbours, and a peer knows only a few): it starts at the peer that holds most (then the faster, then
   the smaller id) and extends either end with a free neighbour: the one that completes the model with the least
   memory to spare, else the one that holds most (ties: the cheaper link, the compute speed closest to the seed's,
   the smaller id). Holding the whole model with as few peers as possible makes the most groups: with compute the
   bottleneck, the swarm's tokens/s is about its total compute over the work per token, whatever the group sizes,
   and fewer hops cost less.
4. **Leftovers.** Idle peers are lost compute, so a site's leftovers join its groups (each the slowest group it has
   a measured link to), except ``SPARE_SHARE`` of the site's peers (at least one), kept as backups: a leaver is then
   replaced by a spare on a fast link. ``ordering.order_group`` then orders and cuts each group, leaving out any
   peer that does not make it faster (a backup too).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from swarm.plan.costs import CostModel
from swarm.plan.linkview import LinkView
from swarm.plan.types import PlanPeer

GAP = 2.0  # a hop cost over 2x the previous one starts a new tier
WIDTH = 4.0  # a tier spans at most 4x in hop cost
EFFICIENCY = 0.8  # a group that holds the model grows on while under this efficiency and each peer raises it
SPARE_SHARE = 0.05  # of a site's peers (at least one) stay backups; its other leftovers join its groups


@dataclass(frozen=True)
class Grouping:
    """Groups of peers (each a path along measured links, able to hold the model; not yet ordered or cut), with
    the tier each was made at (its hop-cost threshold; ``inf``: over unmeasured links), and the backups."""

    groups: tuple[tuple[PlanPeer, ...], ...]
    tiers: tuple[float, ...]
    backups: tuple[PlanPeer, ...]
    joined: tuple[tuple[PlanPeer, ...], ...] = ()  # per ``kept`` group: the peers that join it


def tiers(costs: Iterable[float]) -> list[float]:
    """The tiers' thresholds (each tier's largest cost), ascending."""
    ordered = sorted(set(costs))
    thresholds: list[float] = []
    for i, value in enumerate(ordered):
        if i == 0:
            first = value
            continue
        if value > GAP * ordered[i - 1] or value > WIDTH * first:
            thresholds.append(ordered[i - 1])
            first = value
    if ordered:
        thresholds.append(ordered[-1])
    return thresholds


@dataclass(frozen=True)
class LinkGraph:
    """The measured links among a set of peers, priced: ``near[p]``: ``(hop cost, neighbour)`` sorted;
    ``weight[(a, b)]``: the cost of the pair (the slower direction); ``thresholds``: the tiers."""

    near: dict[str, list[tuple[float, str]]]
    weight: dict[tuple[str, str], float]
    thresholds: tuple[float, ...]


def link_graph(peer_ids: Iterable[str], view: LinkView, cost: CostModel) -> LinkGraph:
    """The ``LinkGraph`` of ``peer_ids`` (built once per plan: ``O(measured links)``)."""
    ids = set(peer_ids)
    near: dict[str, list[tuple[float, str]]] = {pid: [] for pid in ids}
    weight: dict[tuple[str, str], float] = {}
    for a, b in view.pairs():
        if a in ids and b in ids:
            w = max(cost.direction_s(*view(a, b)), cost.direction_s(*view(b, a)))  # both hops' worst
            near[a].append((w, b))
            near[b].append((w, a))
            weight[(a, b)] = weight[(b, a)] = w
    for row in near.values():
        row.sort()
    return LinkGraph(near, weight, tuple(tiers(weight.values())))


def _spanning_cost(group: Sequence[str], weight: dict[tuple[str, str], float]) -> float:
    """The smallest ``w`` such that ``group`` is connected by its measured links costing at most ``w`` (inf: never;
    0 for one peer): the tier the group lives at, whatever its order."""
    edges = sorted((weight[(a, b)], a, b) for i, a in enumerate(group) for b in group[i + 1:] if (a, b) in weight)
    parent = {p: p for p in group}

    def root(p: str) -> str:
        while parent[p] != p:
            p = parent[p]
        return p

    parts, worst = len(group), 0.0
    for w, a, b in edges:
        if parts == 1:
            break
        ra, rb = root(a), root(b)
        if ra != rb:
            parent[ra] = rb
            parts, worst = parts - 1, w
    return worst if parts == 1 else math.inf


def group_peers(peers: Sequence[PlanPeer], num_blocks: int, view: LinkView, cost: CostModel, *,
                kept: Sequence[Sequence[str]] = (), settled: frozenset[str] = frozenset(),
                graph: LinkGraph | None = None) -> Grouping:
    """Split ``peers`` into groups (see the module) and backups. Deterministic: the same input gives the same
    output. ``view`` must list the measured links (``neighbours``); pairs it does not know are never walked.
    ``kept``: groups (peer ids, all in ``peers``) kept from the plan in force: their peers join no new group and
    are not returned, but each counts at its tier (that of the measured links that connect it) as a group made
    there, so a site holding one treats its other peers as a site that made groups would. ``settled``: peers of
    the plan in force (its backups too): they join no kept group (only newcomers do, so an unchanged swarm stays
    put). ``graph``: ``link_graph(ids of peers, view, cost)``, if the caller has it."""
    by_id = {p.peer_id: p for p in peers}
    if len(by_id) != len(peers):
        raise ValueError("group_peers: a peer appears twice")
    graph = graph if graph is not None else link_graph(by_id, view, cost)
    near, thresholds = graph.near, list(graph.thresholds)
    kept_tier: dict[str, float] = {}
    for group in kept:
        slowest = _spanning_cost(group, graph.weight)
        tier = next((t for t in thresholds if t >= slowest), math.inf)
        kept_tier.update((pid, tier) for pid in group)
    held = {pid: min(p.max_blocks, num_blocks) for pid, p in by_id.items()}
    remaining = set(by_id)
    groups: list[tuple[PlanPeer, ...]] = []
    made_at: list[float] = []
    backups: list[str] = []
    kept_index = {pid: g for g, group in enumerate(kept) for pid in group}
    joined: list[list[str]] = [[] for _ in kept]
    for limit in thresholds:
        for component in _components(remaining, near, limit):
            free = [p for p in component if p not in kept_tier]
            here = sorted({kept_index[p] for p in component if kept_tier.get(p, math.inf) <= limit})
            if not here and sum(held[p] for p in free) < num_blocks:
                continue
            paths, left = _grow(free, near, limit, held, num_blocks, by_id, cost)
            if paths or here:
                targets = [list(kept[g]) for g in here] + paths
                extra, left = _join(targets, left, len(component), near, limit, held, by_id, cost,
                                    closed=len(here), settled=settled)
                for g, added in zip(here, extra, strict=False):
                    joined[g].extend(added)
                groups.extend(tuple(by_id[p] for p in path + added)
                              for path, added in zip(paths, extra[len(here):], strict=True))
                made_at.extend([limit] * len(paths))
                backups.extend(left)
                remaining -= {p for p in component if kept_tier.get(p, -1.0) <= limit}
    paths, left = _grow_unmeasured(sorted(p for p in remaining if p not in kept_tier), held, num_blocks, by_id, cost)
    groups.extend(tuple(by_id[p] for p in path) for path in paths)
    made_at.extend([math.inf] * len(paths))
    backups.extend(left)
    return Grouping(tuple(groups), tuple(made_at), tuple(by_id[p] for p in sorted(backups)),
                    tuple(tuple(by_id[p] for p in added) for added in joined))


def _components(remaining: set[str], near: dict[str, list[tuple[float, str]]], limit: float) -> list[list[str]]:
    """Connected components of ``remaining`` along links costing at most ``limit``, each sorted, by first id."""
    parent = {p: p for p in remaining}

    def root(p: str) -> str:
        while parent[p] != p:
            parent[p] = parent[parent[p]]
            p = parent[p]
        return p

    for a in remaining:
        for w, b in near[a]:
            if w > limit:
                break
            if b in parent:
                ra, rb = root(a), root(b)
                if ra != rb:
                    parent[max(ra, rb)] = min(ra, rb)
    members: dict[str, list[str]] = {}
    for p in remaining:
        members.setdefault(root(p), []).append(p)
    return sorted((sorted(m) for m in members.values()), key=lambda m: m[0])


def relaxed_rate(block_s: Sequence[float], held: Sequence[int], num_blocks: int) -> float:
    """Tokens/s of peers sharing ``num_blocks`` blocks by compute alone (``block_s``: seconds per token per block),
    each holding at most ``held`` blocks, fractions allowed: ``1 / T`` for the ``T`` with
    ``sum(min(held_i, T / block_s_i)) = num_blocks`` (0 if they cannot hold the model). A cheap proxy of a group's
    rate (no links, no rounding) for growing groups."""
    if sum(held) < num_blocks:
        return 0.0
    full = sorted(zip((h * c for h, c in zip(held, block_s, strict=True)), held, block_s, strict=True))
    speed = sum(1.0 / c for c in block_s)  # blocks per (second per token) of the peers not yet at their memory
    capped = 0
    for saturate, h, c in full:
        # below T = saturate every peer not yet capped holds T / c_i
        if capped + saturate * speed >= num_blocks:
            return speed / (num_blocks - capped)
        capped += h
        speed -= 1.0 / c
    return 1.0 / full[-1][0]


def _grow(component: Sequence[str], near: dict[str, list[tuple[float, str]]], limit: float, held: dict[str, int],
          num_blocks: int, by_id: dict[str, PlanPeer], cost: CostModel) -> tuple[list[list[str]], list[str]]:
    """Paths of peers along links within ``limit``, each holding the model; and the peers left over, sorted."""
    free = set(component)
    block = {p: cost.block_s(by_id[p]) for p in component}
    seeds = sorted(component, key=lambda p: (-held[p], block[p], p))
    paths: list[list[str]] = []

    def rate(members: Sequence[str]) -> float:
        return relaxed_rate([block[p] for p in members], [held[p] for p in members], num_blocks)

    def efficiency(members: Sequence[str]) -> float:
        return rate(members) * num_blocks / sum(1.0 / block[p] for p in members)

    for seed in seeds:
        if seed not in free:
            continue
        free.discard(seed)
        path, total = [seed], held[seed]
        while True:
            options = []  # (peer, link cost, at the head?)
            for head, end in ((False, path[-1]), (True, path[0])):
                for w, other in near[end]:
                    if w > limit:
                        break
                    if other in free:
                        options.append((other, w, head))
                if len(path) == 1:
                    break
            if not options:
                break
            need = num_blocks - total
            completing = [o for o in options if held[o[0]] >= need]
            if completing:  # the one that makes the fastest group (ties: the cheaper link, the smaller id)
                peer, _, head = min(completing, key=lambda o: (-rate([*path, o[0]]), o[1], o[0], o[2]))
                if total >= num_blocks:  # complete already: grow only while each peer is used better
                    now = efficiency(path)
                    if now >= EFFICIENCY or efficiency([*path, peer]) <= now:
                        break
            else:  # not complete yet: the one with the most memory
                peer, _, head = min(options, key=lambda o: (-held[o[0]], o[1], block[o[0]], o[0], o[2]))
            free.discard(peer)
            if head:
                path.insert(0, peer)
            else:
                path.append(peer)
            total += held[peer]
        if total >= num_blocks:
            paths.append(path)
        else:
            free.update(path)  # a dead end: its peers may still complete a later seed's path
    return paths, sorted(free)


def _join(groups: Sequence[Sequence[str]], left: Sequence[str], size: int, near: dict[str, list[tuple[float, str]]],
          limit: float, held: dict[str, int], by_id: dict[str, PlanPeer], cost: CostModel, *, closed: int = 0,
          settled: frozenset[str] = frozenset()) -> tuple[list[list[str]], list[str]]:
    """Leftovers of a site join its groups: all but the site's spares (``SPARE_SHARE`` of its ``size`` peers, at
    least one: those with the most memory, able to replace anyone), each (most memory first) to the group it has a
    measured link within ``limit`` to whose compute is slowest (the sum of its peers' speeds, a proxy for its
    bottleneck; ``order_group`` then decides, leaving out a peer that does not help). Returns the peers each group
    gets and the backups (the spares, and leftovers next to no group). The first ``closed`` groups take no peer of
    ``settled``."""
    ordered = sorted(left, key=lambda p: (-held[p], cost.block_s(by_id[p]), p))
    spares = max(1, math.ceil(SPARE_SHARE * size))
    group_of = {p: g for g, group in enumerate(groups) for p in group}
    speed = [sum(1.0 / cost.block_s(by_id[p]) for p in group) for group in groups]
    added: list[list[str]] = [[] for _ in groups]
    backups = list(ordered[:spares])
    for peer in ordered[spares:]:
        options = {group_of[other] for w, other in near[peer] if w <= limit and other in group_of
                   and (group_of[other] >= closed or peer not in settled)}
        if not options:
            backups.append(peer)
            continue
        g = min(options, key=lambda g: (speed[g], g))
        added[g].append(peer)
        group_of[peer] = g
        speed[g] += 1.0 / cost.block_s(by_id[peer])
    return added, sorted(backups)


def _grow_unmeasured(remaining: Sequence[str], held: dict[str, int], num_blocks: int, by_id: dict[str, PlanPeer],
                     cost: CostModel) -> tuple[list[list[str]], list[str]]:
    """Groups over links nobody measured (all alike): by memory alone, largest first, each completed by the peer
    with the least memory to spare (else the largest). ``O(n log n)``-ish."""
    pool = sorted((held[p], cost.block_s(by_id[p]), p) for p in remaining)  # ascending memory
    paths: list[list[str]] = []
    left = sum(h for h, _, _ in pool)
    while pool and left >= num_blocks:
        seed = pool.pop()
        path, total = [seed[2]], seed[0]
        while total < num_blocks:  # the pool holds enough: it ends complete
            at = bisect.bisect_left(pool, (num_blocks - total, -math.inf, ""))
            chosen = pool.pop(at if at < len(pool) else len(pool) - 1)
            path.append(chosen[2])
            total += chosen[0]
        paths.append(path)
        left -= total
    return paths, sorted(p for _, _, p in pool)
