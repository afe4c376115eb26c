"""Which peers form a pipeline group: sites of fast links first, each split into as many groups as its peers make.

1. **Tiers.** Each measured link gets its per-token hop cost (``CostModel.hop_s``, the slower direction). Sorted,
   the costs fall into tiers: a new tier starts at a gap (a cost over ``GAP`` x the previous) or when the tier
   would span over ``WIDTH`` x its first cost. Sites of 10 Gbit/s, 100 Mbit/s and 8 Mbit/s links fall apart.
2. **Sites.** From the fastest tier up, the peers still unplaced are joined along the links of this tier or faster
   (connected components). A component whose memory can hold the model is split into groups (3); its peers left
   over become backups (spares on fast links, near the groups they would replace). A component that cannot hold the
   model waits: at the next tier it may join others (groups straddle a slow link only when no faster site can hold
   the model). Last, peers with no measured link that helps are grouped over unmeasured links (their defaults).
3. **Groups as paths.** A group grows as a path along measured links of its tier (a pipeline uses only the links
   between neighbours, and a peer knows only a few): it starts at the peer that holds most (then the faster, then
   the smaller id) and extends either end with a free neighbour: the one that completes the model with the least
   memory to spare, else the one that holds most (ties: the cheaper link, the compute speed closest to the seed's,
   the smaller id). Holding the whole model with as few peers as possible makes the most groups: with compute the
   bottleneck, the swarm's tokens/s is about its total compute over the work per token, whatever the group sizes,
   and fewer hops cost less. ``ordering.order_group`` then orders and cuts each group.
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


@dataclass(frozen=True)
class Grouping:
    """Groups of peers (each a path along measured links, able to hold the model; not yet ordered or cut), with
    the tier each was made at (its hop-cost threshold; ``inf``: over unmeasured links), and the backups."""

    groups: tuple[tuple[PlanPeer, ...], ...]
    tiers: tuple[float, ...]
    backups: tuple[PlanPeer, ...]


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


def group_peers(peers: Sequence[PlanPeer], num_blocks: int, view: LinkView, cost: CostModel, *,
                taken: frozenset[str] = frozenset()) -> Grouping:
    """Split ``peers`` into groups (see the module) and backups. Deterministic: the same input gives the same
    output. ``view`` must list the measured links (``neighbours``); pairs it does not know are never walked.
    ``taken``: ids of ``peers`` already in groups (kept from the plan in force): they join no new group, but a
    site holding them has groups, so its peers left over are backups as for a site that made groups here."""
    by_id = {p.peer_id: p for p in peers}
    if len(by_id) != len(peers):
        raise ValueError("group_peers: a peer appears twice")
    near: dict[str, list[tuple[float, str]]] = {pid: [] for pid in by_id}
    weights = []
    for a, b in view.pairs():
        if a in by_id and b in by_id:
            w = max(cost.direction_s(*view(a, b)), cost.direction_s(*view(b, a)))  # both hops' worst
            near[a].append((w, b))
            near[b].append((w, a))
            weights.append(w)
    for row in near.values():
        row.sort()
    held = {pid: min(p.max_blocks, num_blocks) for pid, p in by_id.items()}
    remaining = set(by_id)
    groups: list[tuple[PlanPeer, ...]] = []
    made_at: list[float] = []
    backups: list[str] = []
    for limit in tiers(weights):
        for component in _components(remaining, near, limit):
            free = [p for p in component if p not in taken]
            if len(free) == len(component) and sum(held[p] for p in component) < num_blocks:
                continue
            paths, left = _grow(free, near, limit, held, num_blocks, by_id, cost)
            if paths or len(free) < len(component):
                groups.extend(tuple(by_id[p] for p in path) for path in paths)
                made_at.extend([limit] * len(paths))
                backups.extend(left)
                remaining -= set(component)
    paths, left = _grow_unmeasured(sorted(remaining - taken), held, num_blocks, by_id, cost)
    groups.extend(tuple(by_id[p] for p in path) for path in paths)
    made_at.extend([math.inf] * len(paths))
    backups.extend(left)
    return Grouping(tuple(groups), tuple(made_at), tuple(by_id[p] for p in sorted(set(backups) - taken)))


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


def _speed_gap(cost: CostModel, a: PlanPeer, b: PlanPeer) -> float:
    return abs(math.log(cost.block_s(a) / cost.block_s(b)))


def _grow(component: Sequence[str], near: dict[str, list[tuple[float, str]]], limit: float, held: dict[str, int],
          num_blocks: int, by_id: dict[str, PlanPeer], cost: CostModel) -> tuple[list[list[str]], list[str]]:
    """Paths of peers along links within ``limit``, each holding the model; and the peers left over, sorted."""
    free = set(component)
    seeds = sorted(component, key=lambda p: (-held[p], cost.block_s(by_id[p]), p))
    paths: list[list[str]] = []
    for seed in seeds:
        if seed not in free:
            continue
        free.discard(seed)
        path, total, first = [seed], held[seed], by_id[seed]
        while total < num_blocks:
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
            sign = 1 if completing else -1  # completing: the least memory to spare; else: the most memory
            peer, _, head = min(completing or options, key=lambda o: (
                sign * held[o[0]], o[1], _speed_gap(cost, by_id[o[0]], first), o[0], o[2]))
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
