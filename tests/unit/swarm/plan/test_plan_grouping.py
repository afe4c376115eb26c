"""Grouping follows the links: tiers by hop cost, groups inside a site when the site can hold the model, across a
slow link only when no faster site can, leftovers as backups, groups walking measured links only."""

from __future__ import annotations

import pytest

from swarm.estimator import ModelShape
from swarm.plan.costs import CostModel
from swarm.plan.grouping import group_peers, relaxed_rate, tiers
from swarm.plan.linkview import LinkView
from swarm.plan.planner import make_plan
from swarm.plan.synthetic import peer_id, synthetic_swarm
from swarm.plan.types import PlanPeer

NUM_BLOCKS = 12
SHAPE = ModelShape(hidden_size=2048, num_blocks=NUM_BLOCKS, dtype_bytes=2)
COST = CostModel(SHAPE)


@pytest.mark.parametrize(("costs", "expected"), [
    ([], []),
    ([1.0], [1.0]),
    ([1.0, 1.5, 1.9, 3.0], [3.0]),  # no gap over 2x, within 4x: one tier
    ([1.0, 1.1, 100.0, 120.0, 1000.0], [1.1, 120.0, 1000.0]),  # gaps
    ([1.0, 1.9, 3.6, 6.8], [3.6, 6.8]),  # no gap, but a tier spans at most 4x
])
def test_tiers(costs, expected):
    assert tiers(costs) == expected


def three_sites(memory: dict[str, int]) -> tuple[list[PlanPeer], LinkView, dict[str, str]]:
    """9 peers, 3 per site: 10 Gbit/s inside a site, 100 Mbit/s between A and B, 8 Mbit/s to C; every link measured.
    ``memory[site]``: blocks each of its peers holds."""
    site = {peer_id(i): "ABC"[i // 3] for i in range(9)}
    peers = [PlanPeer(pid, 1e-3, 2e-3, memory[s]) for pid, s in site.items()]
    links = {}
    for a in site:
        for b in site:
            if a == b:
                continue
            pair = {site[a], site[b]}
            links[(a, b)] = (10e9, 0.001) if len(pair) == 1 else (100e6, 0.01) if pair == {"A", "B"} else (8e6, 0.05)
    return peers, LinkView(links), site


def sites_of(grouping, site: dict[str, str]) -> list[str]:
    return sorted("".join(sorted({site[p.peer_id] for p in group})) for group in grouping.groups)


def test_three_sites_each_holding_the_model_make_groups_inside_their_site():
    peers, view, site = three_sites({"A": 4, "B": 4, "C": 4})
    grouping = group_peers(peers, NUM_BLOCKS, view, COST)
    assert sites_of(grouping, site) == ["A", "B", "C"]
    assert grouping.backups == ()


def test_the_plan_of_three_sites_keeps_groups_off_the_8_mbit_link():
    peers, view, site = three_sites({"A": 4, "B": 4, "C": 4})
    plan = make_plan(peers, NUM_BLOCKS, view, shape=SHAPE, model="m", version=1)
    assert sorted("".join(sorted({site[s.peer_id] for s in g.stages})) for g in plan.groups) == ["A", "B", "C"]
    assert all(g.seconds_per_token == pytest.approx(4 * 3e-3, rel=0.01) for g in plan.groups)  # compute-bound


def test_a_site_that_cannot_hold_the_model_joins_its_neighbour_over_100_mbit_not_8_mbit():
    peers, view, site = three_sites({"A": 2, "B": 2, "C": 4})  # A and B hold 6 each; C holds 12
    grouping = group_peers(peers, NUM_BLOCKS, view, COST)
    assert sites_of(grouping, site) == ["AB", "C"]


def test_leftovers_of_a_site_that_made_groups_are_backups_not_merged_over_the_slow_link():
    peers, view, site = three_sites({"A": 6, "B": 6, "C": 3})  # A: one group of 2 + 1 spare; C cannot hold it
    grouping = group_peers(peers, NUM_BLOCKS, view, COST)
    assert sites_of(grouping, site) == ["A", "B"]
    assert sorted(site[p.peer_id] for p in grouping.backups) == ["A", "B", "C", "C", "C"]


def test_a_peer_holding_the_model_alone_is_a_group_of_one_and_groups_use_as_few_peers_as_they_can():
    peers, view, site = three_sites({"A": 12, "B": 6, "C": 4})
    grouping = group_peers(peers, NUM_BLOCKS, view, COST)
    assert sorted(len(g) for g in grouping.groups) == [1, 1, 1, 2, 3]


def test_peers_with_no_measured_link_are_grouped_over_the_defaults_last():
    peers = [PlanPeer(peer_id(i), 1e-3, 2e-3, m) for i, m in enumerate([6, 6, 5, 1])]
    grouping = group_peers(peers, NUM_BLOCKS, LinkView({}), COST)
    assert [sorted(p.peer_id for p in g) for g in grouping.groups] == [sorted([peer_id(0), peer_id(1)])]
    assert grouping.tiers == (float("inf"),)
    assert [p.peer_id for p in grouping.backups] == [peer_id(2), peer_id(3)]


def test_groups_of_a_sparse_swarm_walk_measured_links_and_name_every_peer_once():
    swarm = synthetic_swarm(400, NUM_BLOCKS, seed=3)
    grouping = group_peers(list(swarm.peers), NUM_BLOCKS, swarm.links, COST)
    named = [p.peer_id for g in grouping.groups for p in g] + [p.peer_id for p in grouping.backups]
    assert sorted(named) == sorted(p.peer_id for p in swarm.peers)
    assert len(grouping.groups) > 50
    for group, tier in zip(grouping.groups, grouping.tiers, strict=True):
        assert sum(min(p.max_blocks, NUM_BLOCKS) for p in group) >= NUM_BLOCKS
        if tier != float("inf"):  # connected by measured links within its tier (a path, and peers joining it)
            ids = [p.peer_id for p in group]
            reached, todo = {ids[0]}, [ids[0]]
            while todo:
                a = todo.pop()
                for b in ids:
                    if b not in reached and swarm.links.known(a, b) and max(
                            COST.hop_s(swarm.links, a, b), COST.hop_s(swarm.links, b, a)) <= tier:
                        reached.add(b)
                        todo.append(b)
            assert reached == set(ids)
    inside = sum(len({swarm.site_of[p.peer_id] for p in g}) == 1 for g in grouping.groups)
    assert inside / len(grouping.groups) > 0.9  # most groups stay on one site


@pytest.mark.parametrize(("block_s", "held", "blocks", "rate"), [
    ([1.0, 1.0], [10, 10], 10, 1 / 5),  # equal peers halve the blocks
    ([1.0, 0.1], [10, 2], 10, 1 / 8),  # the fast one is full at 2 blocks: the slow one holds 8
    ([1.0, 0.5], [10, 10], 9, 1 / 3),  # in proportion to speed: 3 and 6
    ([1.0], [4], 5, 0.0),  # cannot hold the model
])
def test_relaxed_rate(block_s, held, blocks, rate):
    assert relaxed_rate(block_s, held, blocks) == pytest.approx(rate)


def test_a_group_grows_past_holding_the_model_while_each_peer_is_used_better():
    # a slow peer (9 blocks) and a fast one (6) hold the model, the slow one doing 6 blocks (efficiency 0.4); a
    # second fast peer balances it (efficiency 1): it joins; the third is the site's spare
    peers = [PlanPeer(peer_id(0), 4e-3, 8e-3, 9)] + [PlanPeer(peer_id(i), 1e-3, 2e-3, 6) for i in (1, 2, 3)]
    view = LinkView({(a.peer_id, b.peer_id): (10e9, 0.001) for a in peers for b in peers if a is not b})
    grouping = group_peers(peers, NUM_BLOCKS, view, COST)
    assert [sorted(p.peer_id for p in g) for g in grouping.groups] == [[peer_id(0), peer_id(1), peer_id(2)]]
    assert [p.peer_id for p in grouping.backups] == [peer_id(3)]


def test_grouping_is_deterministic_whatever_the_input_order():
    swarm = synthetic_swarm(200, NUM_BLOCKS, seed=5)
    first = group_peers(list(swarm.peers), NUM_BLOCKS, swarm.links, COST)
    again = group_peers(list(reversed(swarm.peers)), NUM_BLOCKS, swarm.links, COST)
    assert first == again
