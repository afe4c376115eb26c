"""The order of a group's peers in its pipeline, and its cut: the smallest bottleneck over orders.

The same search over the bottleneck ``T`` as ``partition``, but over orders too: ``T`` is reachable iff some path
through the group (consecutive hops within ``T``) holds the model with each peer's ``m_i(T)`` blocks.

- When every hop among the peers that can take a block is within ``T`` (a group on one fast site: the usual case),
  any order reaches it, and the test is ``sum m_i(T) >= num_blocks``: exact, ``O(n)``.
- Else, up to ``EXACT_LIMIT`` peers: the heaviest path by dynamic programming over subsets (Held-Karp), exact.
- Beyond: a heuristic: greedy paths (from each peer, on to the unvisited neighbour within ``T`` that holds most).

Ties go to the order the peers already have (``rank``: e.g. their place in the current plan), then to peer ids, so
the same group always gets the same pipeline.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from swarm.plan.costs import CostModel
from swarm.plan.partition import Partition, candidates, hop_matrix, partition
from swarm.plan.types import LinkCost, PlanPeer

EXACT_LIMIT = 8  # peers: the subset search's 2^n x n^2 steps per test stay around 16k


def order_group(peers: Sequence[PlanPeer], num_blocks: int, links: LinkCost, cost: CostModel, *,
                rank: Mapping[str, tuple] | None = None, prefer: Mapping[str, int] | None = None
                ) -> Partition | None:
    """The best pipeline of ``peers`` (order and cut; peers it leaves out are its ``unused``), or None if their
    memory cannot hold the model. ``rank[peer_id]``: a sort key to keep (e.g. the peer's place today) on ties;
    ``prefer[peer_id]``: the block a peer's span ends at today (see ``partition``)."""
    rank = rank or {}
    order = sorted(peers, key=lambda p: (rank.get(p.peer_id, (float("inf"),)), p.peer_id))
    if sum(min(p.max_blocks, num_blocks) for p in order) < num_blocks:
        return None
    if len(order) <= 1:
        return partition(order, num_blocks, links, cost, prefer=prefer)
    hops = hop_matrix(order, links, cost)
    values = candidates(order, num_blocks, cost, hops)
    low, high = 0, len(values) - 1
    found: list[int] | None = list(range(len(order)))  # at the largest candidate any order works
    while low < high:
        middle = (low + high) // 2
        path = _path(order, num_blocks, cost, hops, values[middle])
        if path is None:
            low = middle + 1
        else:
            high, found = middle, path
    if low == len(values) - 1 or found is None:
        found = _path(order, num_blocks, cost, hops, values[low]) or list(range(len(order)))
    rest = [i for i in range(len(order)) if i not in set(found)]
    chosen = [order[i] for i in found] + [order[i] for i in rest]
    index = {p.peer_id: i for i, p in enumerate(order)}
    sub = [[hops[index[a.peer_id]][index[b.peer_id]] for b in chosen] for a in chosen]
    return partition(chosen, num_blocks, links, cost, prefer=prefer, hops=sub)


def _path(order: Sequence[PlanPeer], num_blocks: int, cost: CostModel, hops: Sequence[Sequence[float]],
          limit: float) -> list[int] | None:
    """Indices of peers in a pipeline order reaching ``limit`` (see the module), or None."""
    most = [cost.max_blocks_within(peer, limit) for peer in order]
    able = [i for i, m in enumerate(most) if m > 0]
    if sum(most) < num_blocks:
        return None
    if all(hops[i][j] <= limit for i in able for j in able if i != j):
        return able
    if len(able) <= EXACT_LIMIT:
        return _heaviest_path(able, most, hops, limit, num_blocks)
    return _greedy_path(able, most, hops, limit, num_blocks)


def _heaviest_path(able: Sequence[int], most: Sequence[int], hops: Sequence[Sequence[float]], limit: float,
                   num_blocks: int) -> list[int] | None:
    """Held-Karp: ``best[mask][j]``, the most blocks a path through ``mask`` ending at ``able[j]`` holds."""
    n = len(able)
    best: list[list[int]] = [[-1] * n for _ in range(1 << n)]
    came: list[list[int]] = [[-1] * n for _ in range(1 << n)]
    for j in range(n):
        best[1 << j][j] = most[able[j]]
    for mask in range(1, 1 << n):
        row = best[mask]
        for j in range(n):
            held = row[j]
            if held < 0:
                continue
            if held >= num_blocks:
                path, at, m = [], j, mask
                while at >= 0:
                    path.append(able[at])
                    at, m = came[m][at], m & ~(1 << at)
                return path[::-1]
            for k in range(n):
                if mask & (1 << k) or hops[able[j]][able[k]] > limit:
                    continue
                nxt = mask | (1 << k)
                if held + most[able[k]] > best[nxt][k]:
                    best[nxt][k] = held + most[able[k]]
                    came[nxt][k] = j
    return None


def _greedy_path(able: Sequence[int], most: Sequence[int], hops: Sequence[Sequence[float]], limit: float,
                 num_blocks: int) -> list[int] | None:
    """From each start, repeatedly on to the unvisited peer within ``limit`` that holds most (ties: the cheaper
    hop, then the earlier rank): the first path that holds the model."""
    for start in sorted(able, key=lambda i: (-most[i], i)):
        path, held, seen = [start], most[start], {start}
        while held < num_blocks:
            tail = path[-1]
            options = [k for k in able if k not in seen and hops[tail][k] <= limit]
            if not options:
                break
            nxt = min(options, key=lambda k: (-most[k], hops[tail][k], k))
            path.append(nxt)
            seen.add(nxt)
            held += most[nxt]
        if held >= num_blocks:
            return path
    return None
