"""``plan_graph_cut`` (issue 18, item 2) is optimal: hand-made cases, then brute force over every cut on seeded
random small graphs (heterogeneous peers, skip edges spanning several cuts, forbidden cuts, memory limits)."""

from __future__ import annotations

import itertools
import random

import pytest

from swarm.plan.graph_cut import crossing_bytes, equal_split, evaluate_cuts, node_seconds_from_work, plan_graph_cut


def test_crossing_bytes_counts_a_skip_edge_at_every_cut_it_spans():
    # input (-1 -> 0), a skip from node 0 to node 3, the output of node 3 used at the end (4)
    assert crossing_bytes(4, [(-1, 0, 5.0), (0, 3, 10.0), (0, 1, 1.0), (3, 4, 2.0)]) == [5.0, 11.0, 10.0, 10.0, 2.0]
    with pytest.raises(ValueError, match="not within"):
        crossing_bytes(4, [(2, 1, 1.0)])


def test_a_slow_link_moves_the_cut_to_a_thin_edge():
    seconds = [[1.0] * 6] * 2
    cut_bytes = [0, 100, 100, 1, 100, 100, 0]  # a thin cut before node 3
    assert plan_graph_cut(seconds, cut_bytes, [1e9]).cuts == (3,)
    slow = plan_graph_cut(seconds, [0, 100, 100, 100, 1, 100, 0], [10.0])  # thin cut before node 4 wins
    assert slow.cuts == (4,) and slow.bottleneck == 4.0 and slow.transfer_seconds == (0.1,)
    fast_peer = plan_graph_cut([[1.0] * 6, [0.25] * 6], [0.0] * 7, [1.0])  # the 4x faster peer takes more
    assert fast_peer.cuts == (1,) and fast_peer.stage_seconds == (1.0, 1.25)


def test_brute_force_agrees_on_random_small_graphs():
    rng = random.Random(18)
    checked = limited = 0
    for _ in range(500):
        n, k = rng.randint(2, 9), rng.randint(1, 4)
        k = min(k, n)
        seconds = [[rng.choice([0.0, rng.random(), rng.random() * 5]) for _ in range(n)] for _ in range(k)]
        edges = []
        for _ in range(rng.randint(0, 12)):
            produced = rng.randint(-1, n - 1)
            edges.append((produced, rng.randint(produced + 1, n), float(rng.randint(0, 100))))
        cut_bytes = crossing_bytes(n, edges)
        bandwidths = [rng.uniform(10, 500) for _ in range(k - 1)]
        allowed = [rng.random() < 0.8 for _ in range(n + 1)]
        memory_kw = {}
        if rng.random() < 0.5:  # parameters per node, memory per peer
            memory_kw = {"node_bytes": [float(rng.randint(0, 10)) for _ in range(n)],
                         "memory": [float(rng.randint(5, 40)) for _ in range(k)]}
        combos = [c for c in itertools.combinations([c for c in range(1, n) if allowed[c]], k - 1)
                  if not memory_kw or fits(c, n, **memory_kw)]
        if not combos:
            with pytest.raises(ValueError, match="cannot cut|no cut|do not fit"):
                plan_graph_cut(seconds, cut_bytes, bandwidths, allowed, **memory_kw)
            continue
        best = min(evaluate_cuts(seconds, cut_bytes, bandwidths, c).bottleneck for c in combos)
        got = plan_graph_cut(seconds, cut_bytes, bandwidths, allowed, **memory_kw)
        assert got.bottleneck == best and all(allowed[c] for c in got.cuts) and len(got.cuts) == k - 1
        assert got == evaluate_cuts(seconds, cut_bytes, bandwidths, got.cuts)
        assert not memory_kw or fits(got.cuts, n, **memory_kw)
        checked += 1
        limited += bool(memory_kw)
    assert checked > 300 and limited > 100


def fits(cuts, n, node_bytes, memory) -> bool:
    bounds = [0, *cuts, n]
    return all(sum(node_bytes[a:b]) <= memory[s] for s, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)))


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="2 peers need 1 link bandwidths"):
        plan_graph_cut([[1.0, 1.0]] * 2, [0.0] * 3, [])
    with pytest.raises(ValueError, match="cut_bytes needs 3 entries"):
        plan_graph_cut([[1.0, 1.0]], [0.0] * 2, [])
    with pytest.raises(ValueError, match="cannot cut 2 nodes into 3"):
        plan_graph_cut([[1.0, 1.0]] * 3, [0.0] * 3, [1.0, 1.0])
    with pytest.raises(ValueError, match="must be positive"):
        node_seconds_from_work([1.0], [1.0], [(0.0, 1.0)])
    with pytest.raises(ValueError, match="give both node_bytes and memory"):
        plan_graph_cut([[1.0, 1.0]], [0.0] * 3, [], node_bytes=[1.0, 1.0])
    with pytest.raises(ValueError, match="do not fit the peer's memory"):
        plan_graph_cut([[1.0, 1.0]], [0.0] * 3, [], node_bytes=[1.0, 1.0], memory=[1.5])
    with pytest.raises(ValueError, match="strictly increasing"):
        evaluate_cuts([[1.0] * 4] * 3, [0.0] * 5, [1.0, 1.0], [2, 2])


def test_equal_split_and_roofline_seconds():
    assert equal_split(9, 3) == [3, 6]
    assert equal_split(9, 3, [c != 3 for c in range(10)]) == [2, 6]
    assert node_seconds_from_work([2e9, 0.0], [0.0, 1e9], [(1e9, 1e9), (2e9, 4e9)]) == [[2.0, 1.0], [1.0, 0.25]]
