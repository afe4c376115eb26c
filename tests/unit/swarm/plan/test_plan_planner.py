"""``make_plan`` (valid, deterministic, keeps peers in place when that is free), ``should_adopt`` (hysteresis) and
the planner's input from records (``plan_peers``, ``link_view_from_records`` agree with ``swarm.links``)."""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys

import pytest

from swarm.estimator import ModelShape
from swarm.links import DEFAULT_BANDWIDTH, LinkTable, link_between
from swarm.plan import (
    CostModel,
    LinkView,
    Plan,
    PlanPeer,
    link_view_from_records,
    make_plan,
    plan_peers,
    reprice,
    should_adopt,
)
from swarm.plan.planner import KEEP_MARGIN
from swarm.plan.synthetic import peer_id, synthetic_swarm
from swarm.records import LinkRow, PeerRecord, PeerState

NUM_BLOCKS = 16
SHAPE = ModelShape(hidden_size=2048, num_blocks=NUM_BLOCKS, dtype_bytes=2)


def plan(peers, links, current: Plan | None = None, version: int = 1, objective: str = "training") -> Plan:
    return make_plan(list(peers), NUM_BLOCKS, links, shape=SHAPE, objective=objective, model="m", version=version,
                     broker=peer_id(999), now=1.0e9, current=current)


def moved(before: Plan, after: Plan) -> set[str]:
    """Peers whose span (or backup role) differs."""
    return {p for p in set(before.peers) | set(after.peers) if before.place_of(p) != after.place_of(p)}


@pytest.mark.parametrize("objective", ["training", "inference"])
def test_a_plan_names_every_peer_once_and_prices_its_groups_with_the_cost_model(objective):
    swarm = synthetic_swarm(300, NUM_BLOCKS, seed=11)
    result = plan(swarm.peers, swarm.links, objective=objective)
    assert result.peers == tuple(sorted(p.peer_id for p in swarm.peers))
    assert (result.model, result.version, result.broker, result.made_at, result.objective) == (
        "m", 1, peer_id(999), 1.0e9, objective)
    cost = CostModel(SHAPE, objective)
    by_id = {p.peer_id: p for p in swarm.peers}
    for group in result.groups:
        assert all(s.end - s.start <= by_id[s.peer_id].max_blocks for s in group.stages)
        spans = [(by_id[s.peer_id], s.end - s.start) for s in group.stages]
        assert group.seconds_per_token == pytest.approx(cost.bottleneck(spans, swarm.links))
    rates = [g.seconds_per_token for g in result.groups]
    assert rates == sorted(rates)
    assert Plan.from_wire(result.to_wire()) == result


def test_the_same_snapshot_gives_the_same_plan_whatever_the_order():
    swarm = synthetic_swarm(300, NUM_BLOCKS, seed=12)
    shuffled = list(swarm.peers)
    random.Random(0).shuffle(shuffled)
    assert plan(swarm.peers, swarm.links) == plan(shuffled, swarm.links)


def test_replanning_an_unchanged_swarm_moves_nobody():
    swarm = synthetic_swarm(300, NUM_BLOCKS, seed=13)
    first = plan(swarm.peers, swarm.links)
    again = plan(swarm.peers, swarm.links, current=first, version=2)
    assert moved(first, again) == set()
    assert not should_adopt(first, again, swarm.peers, swarm.links, shape=SHAPE)


def test_a_leaver_and_a_joiner_move_few_peers():
    swarm = synthetic_swarm(300, NUM_BLOCKS, seed=14)
    first = plan(swarm.peers, swarm.links)
    leaver = first.groups[0].stages[0].peer_id
    joiner = PlanPeer(peer_id(5000), 1e-3, 2e-3, NUM_BLOCKS)
    peers = [p for p in swarm.peers if p.peer_id != leaver] + [joiner]
    again = plan(peers, swarm.links, current=first, version=2)
    fresh = plan(peers, swarm.links, version=2)
    assert again.tokens_per_s * (1 + KEEP_MARGIN) >= fresh.tokens_per_s  # keeping costs little
    assert len(moved(first, again) - {leaver, joiner.peer_id}) <= len(first.groups[0].stages) + 2
    assert len(moved(first, fresh)) > len(moved(first, again))
    exact = make_plan(peers, NUM_BLOCKS, swarm.links, shape=SHAPE, model="m", version=2, current=first, keep_margin=0)
    assert exact.tokens_per_s >= fresh.tokens_per_s * (1 - 1e-9)  # keep_margin 0: keep only when it costs nothing
    assert should_adopt(first, again, peers, swarm.links, shape=SHAPE)  # a peer of the current plan is gone


def test_current_groups_keep_their_order_when_any_order_is_as_fast():
    peers = [PlanPeer(peer_id(i), 1e-3, 2e-3, 8) for i in range(4)]
    links = LinkView({(a.peer_id, b.peer_id): (10e9, 0.001) for a in peers for b in peers if a is not b})
    first = plan(peers, links)
    assert [len(g.stages) for g in first.groups] == [2, 2]
    swapped = dataclasses.replace(first, groups=tuple(
        dataclasses.replace(g, stages=tuple(
            dataclasses.replace(s, start=NUM_BLOCKS - s.end, end=NUM_BLOCKS - s.start) for s in reversed(g.stages)))
        for g in first.groups))
    assert plan(peers, links, current=swapped).groups == swapped.groups


# ---- hysteresis ----------------------------------------------------------------------------------------------
def two_peer_plan(seconds: float) -> Plan:
    swarm_peers = [PlanPeer(peer_id(i), seconds / 16, seconds / 8, 16) for i in range(2)]
    return plan(swarm_peers, LinkView({}))


def test_should_adopt_needs_the_margin_over_the_current_plan_priced_today():
    peers = [PlanPeer(peer_id(i), 1e-3, 2e-3, 16) for i in range(2)]  # two 1-peer groups: 48 ms per token each
    links = LinkView({})
    current = plan(peers, links)
    today = reprice(current, peers, links, shape=SHAPE)
    assert today.tokens_per_s == pytest.approx(current.tokens_per_s)
    better = lambda factor: dataclasses.replace(current, groups=tuple(  # noqa: E731
        dataclasses.replace(g, seconds_per_token=g.seconds_per_token / factor) for g in current.groups))
    assert not should_adopt(current, better(1.10), peers, links, shape=SHAPE)
    assert should_adopt(current, better(1.20), peers, links, shape=SHAPE)
    assert should_adopt(current, better(1.10), peers, links, margin=0.05, shape=SHAPE)
    assert should_adopt(None, current, peers, links, shape=SHAPE)
    # today's measurements: the current plan's peers got slower, so the same candidate now clears the margin
    slower = [dataclasses.replace(p, forward_s=1.2e-3, backward_s=2.4e-3) for p in peers]
    assert should_adopt(current, better(1.0), slower, links, shape=SHAPE)


def test_should_adopt_when_the_current_plan_no_longer_works():
    peers = [PlanPeer(peer_id(i), 1e-3, 2e-3, 16) for i in range(2)]
    current = plan(peers, LinkView({}))
    assert should_adopt(current, current, peers[:1], LinkView({}), shape=SHAPE)  # a stage's peer is gone
    smaller = [dataclasses.replace(p, max_blocks=8) for p in peers]
    assert reprice(current, smaller, LinkView({}), shape=SHAPE) is None  # spans no longer fit
    assert should_adopt(current, current, smaller, LinkView({}), shape=SHAPE)
    assert should_adopt(current, dataclasses.replace(current, objective="inference"), peers, LinkView({}),
                        shape=SHAPE)
    assert should_adopt(current, dataclasses.replace(current, model="other"), peers, LinkView({}), shape=SHAPE)
    with pytest.raises(ValueError, match="margin"):
        should_adopt(current, current, peers, LinkView({}), margin=-0.1, shape=SHAPE)


def test_make_plan_refuses_bad_input():
    peers = [PlanPeer(peer_id(1), 1e-3, 2e-3, 16)]
    with pytest.raises(ValueError, match="twice"):
        make_plan(peers * 2, NUM_BLOCKS, LinkView({}), shape=SHAPE, model="m", version=1)
    with pytest.raises(ValueError, match="num_blocks"):
        make_plan(peers, 8, LinkView({}), shape=SHAPE, model="m", version=1)
    big = [PlanPeer(peer_id(i), 1e-3, 2e-3, 16) for i in range(400)]
    with pytest.raises(ValueError, match="LinkView"):
        make_plan(big, NUM_BLOCKS, lambda a, b: (1e9, 0.001), shape=SHAPE, model="m", version=1)
    small = make_plan(big[:3], NUM_BLOCKS, lambda a, b: (1e9, 0.001), shape=SHAPE, model="m", version=1)
    assert len(small.groups) == 3  # a plain link function is fine for a small swarm


# ---- from records --------------------------------------------------------------------------------------------
def record(i: int, state: PeerState = PeerState.ONLINE, links: tuple[LinkRow, ...] = (), **kwargs) -> PeerRecord:
    return PeerRecord(peer_id=peer_id(i), model="m", start=0, end=4, state=state, throughput=100.0, links=links,
                      **kwargs)


def test_plan_peers_takes_serving_joining_and_backup_peers_with_their_compute_and_memory():
    records = [record(1, forward_seconds=0.002, backward_seconds=0.005, max_blocks=12), record(2, PeerState.JOINING),
               record(3, PeerState.BACKUP), record(4, PeerState.OFFLINE)]
    peers = plan_peers(records)
    assert [p.peer_id for p in peers] == [peer_id(1), peer_id(2), peer_id(3)]
    assert peers[0] == PlanPeer(peer_id(1), 0.002, 0.005, 12)
    assert peers[1] == PlanPeer(peer_id(2), 0.01, 0.02, 4)  # throughput 100/s; backward 2x; memory = its span


def test_link_view_from_records_answers_as_link_between():
    rows = {1: (LinkRow(peer_id(2), 50e6, 0.02, 1.0), LinkRow(peer_id(3), 0.0, 0.03, 1.0)),
            2: (LinkRow(peer_id(1), 60e6, 0.021, 1.0),), 4: (LinkRow(peer_id(3), 1e9, 0.002, 1.0),)}
    records = [record(i, links=rows.get(i, ())) for i in range(1, 6)]
    table = LinkTable(clock=lambda: 0.0)
    table.observe(peer_id(3), 0.004, 0.0, 100)
    view = link_view_from_records(records, table, peer_id(5))
    for a in range(1, 6):
        for b in range(1, 6):
            if a != b:
                known = link_between(peer_id(a), peer_id(b), records, table, peer_id(5))
                assert view(peer_id(a), peer_id(b)) == (known.bandwidth, known.rtt), (a, b)
    assert view(peer_id(1), peer_id(3)) == (DEFAULT_BANDWIDTH, 0.03)  # only the round trip was measured
    assert view.neighbours(peer_id(3)) == (peer_id(1), peer_id(4), peer_id(5))
    assert view.neighbours(peer_id(2)) == (peer_id(1),)


def test_the_plan_does_not_depend_on_the_hash_seed():
    # sets of peer ids iterate in an order that changes with PYTHONHASHSEED: the plan must not
    script = ("import hashlib, json; from swarm.estimator import ModelShape; from swarm.plan import make_plan; "
              "from swarm.plan.synthetic import synthetic_swarm; s = synthetic_swarm(200, 16, seed=4); "
              "p = make_plan(list(s.peers), 16, s.links, shape=ModelShape(2048, 16, 2), model='m', version=1); "
              "print(hashlib.sha256(json.dumps(p.to_wire(), sort_keys=True).encode()).hexdigest())")
    outputs = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(outputs) == 1
