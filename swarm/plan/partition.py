"""The optimal cut of a model's blocks over peers in a fixed order (exact).

Peers in order ``p1 .. pn`` get contiguous spans tiling ``[0, num_blocks)`` in that order; a peer may get none (it
is left out, and the hop then joins its neighbours in the pipeline). The bottleneck to minimise is the slowest of
the stages' and hops' per-token seconds (``CostModel``).

Exact by a search over the bottleneck: every optimum equals one of the candidate values (a stage's time with some
number of blocks, or a hop's time), and whether a bottleneck ``T`` is reachable is monotone in ``T``, so a binary
search over the sorted candidates finds the smallest reachable one. For a given ``T`` each peer holds at most
``m_i(T)`` blocks (``CostModel.max_blocks_within``), and ``T`` is reachable iff some subsequence of peers whose
consecutive hops cost at most ``T`` holds ``num_blocks`` in all: a longest-path recurrence over the order,
``g_i = m_i + max(0, max over earlier k with hop(k, i) <= T of g_k)``, ``O(n^2)`` per test.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from swarm.plan.costs import CostModel
from swarm.plan.types import Assignment, Group, LinkCost, PlanPeer


@dataclass(frozen=True)
class Partition:
    """A cut: ``spans`` (peer, start, end) in pipeline order, every span non-empty, tiling ``[0, num_blocks)``;
    ``seconds_per_token`` is its bottleneck; ``unused``: the given peers that got no blocks."""

    spans: tuple[tuple[PlanPeer, int, int], ...]
    seconds_per_token: float
    unused: tuple[PlanPeer, ...] = ()

    @property
    def peers(self) -> tuple[PlanPeer, ...]:
        return tuple(peer for peer, _, _ in self.spans)

    def group(self) -> Group:
        """As a plan's ``Group`` (``ValueError`` if a peer id is not a valid libp2p id)."""
        return Group(tuple(Assignment(peer.peer_id, start, end) for peer, start, end in self.spans),
                     self.seconds_per_token)


def hop_matrix(order: Sequence[PlanPeer], links: LinkCost, cost: CostModel) -> list[list[float]]:
    """``hops[i][j]``: per-token seconds of the hop from ``order[i]`` to ``order[j]`` (0 on the diagonal)."""
    return [[0.0 if i == j else cost.hop_s(links, a.peer_id, b.peer_id) for j, b in enumerate(order)]
            for i, a in enumerate(order)]


def candidates(peers: Sequence[PlanPeer], num_blocks: int, cost: CostModel, hops: Sequence[Sequence[float]]
               ) -> list[float]:
    """Every value an optimal bottleneck can take, sorted: stage times for 1..max_blocks blocks, hop times."""
    values = {t for peer in peers for t in cost.stage_times(peer, min(peer.max_blocks, num_blocks))}
    values.update(h for row in hops for h in row if h > 0)
    return sorted(values)


def partition(order: Sequence[PlanPeer], num_blocks: int, links: LinkCost, cost: CostModel, *,
              prefer: Mapping[str, int] | None = None, hops: Sequence[Sequence[float]] | None = None
              ) -> Partition | None:
    """The cut of ``[0, num_blocks)`` over ``order`` (peers in pipeline order) with the smallest bottleneck, or None
    if their memory (``max_blocks``) cannot hold the model. ``links(a, b)`` gives ``(bits/s, rtt)``; ``cost`` the
    per-token costs. Among optimal cuts: the fewest leading peers, then each span's end as close as it may be to
    ``prefer[peer_id]`` (e.g. where it ends today), else spans in proportion to what each peer can hold.
    ``hops``: a precomputed ``hop_matrix(order, links, cost)``."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    order = list(order)
    if len({p.peer_id for p in order}) != len(order):
        raise ValueError("partition: a peer appears twice in the order")
    if sum(min(p.max_blocks, num_blocks) for p in order) < num_blocks:
        return None
    hops = hop_matrix(order, links, cost) if hops is None else hops
    values = candidates(order, num_blocks, cost, hops)
    low, high = 0, len(values) - 1
    while low < high:  # the largest candidate is always reachable: every hop and every full stage fits under it
        middle = (low + high) // 2
        if _chain(order, num_blocks, cost, hops, values[middle]) is None:
            low = middle + 1
        else:
            high = middle
    best = values[low]
    chain = _chain(order, num_blocks, cost, hops, best)
    assert chain is not None
    spans = _cut([order[i] for i in chain], [cost.max_blocks_within(order[i], best) for i in chain], num_blocks,
                 prefer or {})
    used = {i for i in chain}
    real = cost.bottleneck([(peer, end - start) for peer, start, end in spans], links)
    return Partition(tuple(spans), real, tuple(p for i, p in enumerate(order) if i not in used))


def _chain(order: Sequence[PlanPeer], num_blocks: int, cost: CostModel, hops: Sequence[Sequence[float]],
           limit: float) -> list[int] | None:
    """Indices of a subsequence of ``order`` holding ``num_blocks`` with every stage and hop within ``limit``, the
    shortest suffix of the first such chain found; None if there is none."""
    most = [cost.max_blocks_within(peer, limit) for peer in order]
    if sum(most) < num_blocks:
        return None
    reach = [0] * len(order)
    before: list[int | None] = [None] * len(order)
    for i in range(len(order)):
        if most[i] == 0:
            continue
        best, previous = 0, None
        for k in range(i):
            if reach[k] > best and hops[k][i] <= limit:
                best, previous = reach[k], k
        reach[i], before[i] = most[i] + best, previous
        if reach[i] >= num_blocks:
            chain: list[int] = []
            at: int | None = i
            while at is not None:
                chain.append(at)
                at = before[at]
            chain.reverse()
            while len(chain) > 1 and sum(most[j] for j in chain[1:]) >= num_blocks:
                chain.pop(0)  # fewer stages, fewer hops: the leading peers are not needed
            return chain
    return None


def _cut(peers: Sequence[PlanPeer], most: Sequence[int], num_blocks: int, prefer: Mapping[str, int]
         ) -> list[tuple[PlanPeer, int, int]]:
    """Spans for ``peers`` (each 1..most[i] blocks, ``sum(most) >= num_blocks``, ``len(peers) <= num_blocks``)."""
    spans, start = [], 0
    for i, peer in enumerate(peers):
        rest = most[i + 1:]
        low = max(start + 1, num_blocks - sum(rest))  # the rest can hold what this one leaves
        high = min(start + most[i], num_blocks - len(rest))  # each of the rest gets at least one block
        if peer.peer_id in prefer:
            target = prefer[peer.peer_id]
        else:
            target = start + round((num_blocks - start) * most[i] / (most[i] + sum(rest)))
        end = min(max(target, low), high)
        spans.append((peer, start, end))
        start = end
    return spans
