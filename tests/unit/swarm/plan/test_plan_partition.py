"""``partition`` (fixed order) and ``order_group`` (any order) are optimal: hand-made tables, then brute force over
every cut (and every order) on seeded random small cases with memory limits and slow links."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import pytest

from swarm.estimator import ModelShape, StreamCost
from swarm.plan.costs import CostModel
from swarm.plan.ordering import EXACT_LIMIT, order_group
from swarm.plan.partition import Partition, partition
from swarm.plan.synthetic import peer_id
from swarm.plan.types import PlanPeer

FREE = StreamCost(send_s=0.0, recv_s=0.0, cpu_s_per_byte=0.0, transit_s=0.0, daemon_rate=1e18)
P = [peer_id(i) for i in range(12)]


def cost_for(num_blocks: int, objective: str = "training") -> CostModel:
    return CostModel(ModelShape(hidden_size=1000, num_blocks=num_blocks, dtype_bytes=4), objective, stream=FREE)


def uniform(bandwidth: float = 1e12):
    return lambda a, b: (bandwidth, 0.0)


def spans(cut: Partition) -> list[tuple[str, int, int]]:
    return [(p.peer_id, s, e) for p, s, e in cut.spans]


def check_cut(cut: Partition, order: list[PlanPeer], num_blocks: int, links, cost: CostModel) -> None:
    """The cut tiles the blocks in ``order``'s order, within memory, and its bottleneck is what it claims."""
    assert cut.spans[0][1] == 0 and cut.spans[-1][2] == num_blocks
    for (_, _, end), (_, start, _) in zip(cut.spans, cut.spans[1:], strict=False):
        assert end == start
    positions = [order.index(p) for p, _, _ in cut.spans]
    assert positions == sorted(positions)
    assert all(0 < e - s <= p.max_blocks for p, s, e in cut.spans)
    assert cut.seconds_per_token == pytest.approx(cost.bottleneck([(p, e - s) for p, s, e in cut.spans], links))
    assert {p.peer_id for p in cut.unused} == {p.peer_id for p in order} - {p.peer_id for p, _, _ in cut.spans}


# ---- tables --------------------------------------------------------------------------------------------------
def test_equal_peers_split_evenly():
    order = [PlanPeer(P[i], 1e-3, 2e-3, 8) for i in range(4)]
    cut = partition(order, 8, uniform(), cost_for(8))
    assert spans(cut) == [(P[0], 0, 2), (P[1], 2, 4), (P[2], 4, 6), (P[3], 6, 8)]
    assert cut.seconds_per_token == pytest.approx(2 * 3e-3)


def test_a_twice_faster_peer_takes_twice_the_blocks():
    order = [PlanPeer(P[0], 1e-3, 2e-3, 9), PlanPeer(P[1], 0.5e-3, 1e-3, 9)]
    cut = partition(order, 9, uniform(), cost_for(9))
    assert spans(cut) == [(P[0], 0, 3), (P[1], 3, 9)]


def test_memory_limits_the_fast_peer():
    order = [PlanPeer(P[0], 1e-3, 2e-3, 9), PlanPeer(P[1], 0.1e-3, 0.2e-3, 2)]
    assert spans(partition(order, 9, uniform(), cost_for(9))) == [(P[0], 0, 7), (P[1], 7, 9)]


def test_a_slow_hop_is_avoided_by_leaving_a_peer_out():
    # three equal peers, each holding the whole model; the hop into the middle one is slow: the best pipeline
    # skips it (the first and last share the blocks over their fast link)
    order = [PlanPeer(P[i], 1e-3, 2e-3, 8) for i in range(3)]
    slow = {(P[0], P[1]), (P[1], P[0])}
    links = lambda a, b: (1e5, 0.0) if (a, b) in slow else (1e12, 0.0)  # noqa: E731
    cut = partition(order, 8, links, cost_for(8))
    assert spans(cut) == [(P[0], 0, 4), (P[2], 4, 8)]
    assert [p.peer_id for p in cut.unused] == [P[1]]


def test_too_little_memory_has_no_cut():
    order = [PlanPeer(P[0], 1e-3, 2e-3, 3), PlanPeer(P[1], 1e-3, 2e-3, 4)]
    assert partition(order, 8, uniform(), cost_for(8)) is None
    assert order_group(order, 8, uniform(), cost_for(8)) is None


def test_prefer_keeps_a_span_where_it_ends_today_when_that_costs_nothing():
    order = [PlanPeer(P[i], 1e-3, 2e-3, 4) for i in range(3)]  # 3 x 4 blocks of memory for 9 blocks
    links = lambda a, b: (1e6, 0.0)  # noqa: E731  link-bound: any cut over the three is optimal
    cost = cost_for(9)
    plain = partition(order, 9, links, cost)
    assert spans(plain) == [(P[0], 0, 3), (P[1], 3, 6), (P[2], 6, 9)]  # in proportion to memory
    kept = partition(order, 9, links, cost, prefer={P[0]: 2, P[1]: 5})
    assert spans(kept) == [(P[0], 0, 2), (P[1], 2, 5), (P[2], 5, 9)]
    assert kept.seconds_per_token == pytest.approx(plain.seconds_per_token)
    clamped = partition(order, 9, links, cost, prefer={P[0]: 1, P[1]: 9})  # P[2] must get 1..4 blocks
    assert spans(clamped) == [(P[0], 0, 1), (P[1], 1, 5), (P[2], 5, 9)]


def test_refuses_a_repeated_peer_and_no_blocks():
    peer = PlanPeer(P[0], 1e-3, 2e-3, 8)
    with pytest.raises(ValueError, match="twice"):
        partition([peer, peer], 8, uniform(), cost_for(8))
    with pytest.raises(ValueError, match="num_blocks"):
        partition([peer], 0, uniform(), cost_for(8))


# ---- brute force ---------------------------------------------------------------------------------------------
def compositions(total: int, limits: list[int]) -> Iterator[tuple[int, ...]]:
    """Every way to give ``total`` blocks to peers with at most ``limits[i]`` each (0 allowed)."""
    if not limits:
        if total == 0:
            yield ()
        return
    for first in range(min(total, limits[0]) + 1):
        for rest in compositions(total - first, limits[1:]):
            yield (first, *rest)


def brute_partition(order: list[PlanPeer], num_blocks: int, links, cost: CostModel) -> float | None:
    best = None
    for counts in compositions(num_blocks, [p.max_blocks for p in order]):
        value = cost.bottleneck(list(zip(order, counts, strict=True)), links)
        best = value if best is None else min(best, value)
    return best


def random_case(rng: random.Random, n: int, num_blocks: int):
    """Peers of mixed speed and memory; links from three tiers (10 Gbit/s, 100 Mbit/s, 8 Mbit/s), not symmetric,
    priced so that both links and compute can be the bottleneck."""
    peers = [PlanPeer(P[i], rng.choice([1e-4, 3e-4, 1e-3, 2e-3]), rng.choice([2e-4, 1e-3, 3e-3]),
                      rng.randint(1, num_blocks)) for i in range(n)]
    tiers = [10e9, 100e6, 8e6]
    table = {(a.peer_id, b.peer_id): (rng.choice(tiers), rng.choice([0.001, 0.05]))
             for a in peers for b in peers if a is not b}
    return peers, (lambda a, b: table[(a, b)])


@pytest.mark.parametrize("objective", ["training", "inference"])
def test_partition_matches_brute_force_on_random_small_cases(objective):
    rng = random.Random(13)
    checked = infeasible = 0
    for _ in range(150):
        n, num_blocks = rng.randint(1, 5), rng.randint(1, 8)
        peers, links = random_case(rng, n, num_blocks)
        cost = cost_for(num_blocks, objective)
        cut = partition(peers, num_blocks, links, cost)
        best = brute_partition(peers, num_blocks, links, cost)
        if best is None:
            assert cut is None
            infeasible += 1
            continue
        check_cut(cut, peers, num_blocks, links, cost)
        assert cut.seconds_per_token == pytest.approx(best, rel=1e-12)
        checked += 1
    assert checked > 80 and infeasible > 5  # both kinds of case were drawn


def test_order_group_matches_brute_force_over_orders_and_cuts():
    rng = random.Random(7)
    exact_branch = 0
    for _ in range(40):
        n, num_blocks = rng.randint(2, 4), rng.randint(2, 7)
        peers, links = random_case(rng, n, num_blocks)
        cost = cost_for(num_blocks)
        best = min((b for order in itertools.permutations(peers)
                    if (b := brute_partition(list(order), num_blocks, links, cost)) is not None), default=None)
        found = order_group(peers, num_blocks, links, cost)
        if best is None:
            assert found is None
            continue
        chosen = [p for p, _, _ in found.spans] + list(found.unused)
        check_cut(found, chosen, num_blocks, links, cost)
        assert found.seconds_per_token == pytest.approx(best, rel=1e-12)
        exact_branch += found.seconds_per_token > max(cost.stage_s(p, e - s) for p, s, e in found.spans)
    assert exact_branch > 3  # cases where a hop is the bottleneck, so the order mattered


@pytest.mark.parametrize("n", [5, 6])
def test_order_group_matches_all_orders_with_the_exact_partition(n):
    # larger groups: brute force over orders, each cut by ``partition`` (proven exact above)
    assert n <= EXACT_LIMIT
    rng = random.Random(n)
    for _ in range(6 if n == 5 else 3):
        num_blocks = rng.randint(n, 2 * n)
        peers, links = random_case(rng, n, num_blocks)
        cost = cost_for(num_blocks)
        best = min((c.seconds_per_token for order in itertools.permutations(peers)
                    if (c := partition(list(order), num_blocks, links, cost)) is not None), default=None)
        found = order_group(peers, num_blocks, links, cost)
        assert (found is None) == (best is None)
        if found is not None:
            assert found.seconds_per_token == pytest.approx(best, rel=1e-12)


def test_order_group_beyond_the_exact_limit_finds_the_fast_path_through_a_ring():
    # 12 peers; only the hops i -> i+1 (mod 12) are fast, the rest are 8 Mbit/s: the heuristic must follow the ring
    n, num_blocks = 12, 24
    peers = [PlanPeer(P[i], 1e-3, 2e-3, 2) for i in range(n)]
    fast = {(P[i], P[(i + 1) % n]) for i in range(n)} | {(P[(i + 1) % n], P[i]) for i in range(n)}
    links = lambda a, b: (10e9, 0.001) if (a, b) in fast else (8e6, 0.05)  # noqa: E731
    cost = cost_for(num_blocks)
    found = order_group(list(reversed(peers)), num_blocks, links, cost)
    assert found.seconds_per_token == pytest.approx(2 * 3e-3)  # compute-bound: every hop on the ring
    ids = [p.peer_id for p, _, _ in found.spans]
    assert all((a, b) in fast for a, b in zip(ids, ids[1:], strict=False))


def test_order_group_keeps_the_given_rank_on_ties():
    peers = [PlanPeer(P[i], 1e-3, 2e-3, 8) for i in range(3)]
    rank = {P[2]: (0, 0), P[0]: (0, 3), P[1]: (0, 6)}
    found = order_group(peers, 9, uniform(), cost_for(9), rank=rank)
    assert [p.peer_id for p, _, _ in found.spans] == [P[2], P[0], P[1]]
