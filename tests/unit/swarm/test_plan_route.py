"""Routing along a plan: the client picks the live group the estimator prices fastest for it (its own links)."""

from __future__ import annotations

import asyncio

from swarm.estimator import ModelShape
from swarm.links import LinkTable
from swarm.plan.route import choose_group, plan_route, price_groups
from swarm.plan.types import Assignment, Group, Plan
from swarm.records import LinkRow, PeerRecord, PeerState
from swarm.routing import Hop, Router

MODEL = "llama-tiny"
SHAPE = ModelShape(hidden_size=64, num_blocks=4)
ME = "12D3KooW" + "Z" * 44


def pid(name: str) -> str:
    return "12D3KooW" + name * 44


def rec(name: str, start: int, end: int, state: PeerState = PeerState.ONLINE, links=()) -> PeerRecord:
    return PeerRecord(peer_id=pid(name), model=MODEL, start=start, end=end, state=state, throughput=0.0,
                      forward_seconds=1e-4, backward_seconds=2e-4, links=tuple(links))


def two_group_plan() -> Plan:
    far = Group((Assignment(pid("A"), 0, 2), Assignment(pid("B"), 2, 4)), seconds_per_token=0.01)
    near = Group((Assignment(pid("C"), 0, 2), Assignment(pid("D"), 2, 4)), seconds_per_token=0.01)
    return Plan(model=MODEL, num_blocks=4, version=1, groups=(far, near), broker=pid("T"))


def records():
    # A-B and C-D are both on a fast LAN between themselves; what differs is the client's links to them
    lan = dict(bandwidth=1e9, rtt=0.0005, age=1.0)
    return [rec("A", 0, 2, links=[LinkRow(pid("B"), **lan)]), rec("B", 2, 4),
            rec("C", 0, 2, links=[LinkRow(pid("D"), **lan)]), rec("D", 2, 4)]


def client_links(far_rtt: float, near_rtt: float) -> LinkTable:
    table = LinkTable(clock=lambda: 0.0)
    for name, rtt in (("A", far_rtt), ("B", far_rtt), ("C", near_rtt), ("D", near_rtt)):
        for _ in range(3):
            table.observe(pid(name), rtt, 0.0, 100)
    return table


def test_the_group_nearest_the_client_is_chosen():
    plan, recs = two_group_plan(), records()
    near_cd = client_links(far_rtt=0.080, near_rtt=0.002)
    assert plan_route([plan], recs, SHAPE, 0, 4, client_id=ME, local=near_cd) == [(pid("C"), 0, 2),
                                                                                   (pid("D"), 2, 4)]
    near_ab = client_links(far_rtt=0.002, near_rtt=0.080)  # the same swarm seen from another client
    assert plan_route([plan], recs, SHAPE, 0, 4, client_id=ME, local=near_ab) == [(pid("A"), 0, 2),
                                                                                   (pid("B"), 2, 4)]
    priced = price_groups([plan], recs, SHAPE, client_id=ME, local=near_cd)
    assert priced[0].seconds < priced[1].seconds  # ordered by the estimate, not by the plan's order
    assert plan_route([plan], recs, SHAPE, 1, 3, client_id=ME, local=near_cd) == [(pid("C"), 1, 2),
                                                                                   (pid("D"), 2, 3)]


def test_groups_that_are_not_live_or_excluded_are_skipped():
    plan, near_cd = two_group_plan(), client_links(far_rtt=0.080, near_rtt=0.002)
    moved = [r if r.peer_id != pid("D") else rec("D", 1, 4) for r in records()]  # D has not moved yet
    assert plan_route([plan], moved, SHAPE, 0, 4, client_id=ME, local=near_cd)[0][0] == pid("A")
    assert plan_route([plan], records(), SHAPE, 0, 4, client_id=ME, local=near_cd,
                      excluded={pid("C")})[0][0] == pid("A")
    offline = [r if r.peer_id != pid("A") else rec("A", 0, 2, PeerState.OFFLINE) for r in moved]
    assert plan_route([plan], offline, SHAPE, 0, 4, client_id=ME, local=near_cd) is None
    assert plan_route([], records(), SHAPE, 0, 4) is None


def test_a_trainer_waits_a_while_for_the_fastest_group_to_move():
    """The broker's choice (``choose_group``): the first group to move is not taken while a clearly faster one is
    still moving, unless it is about as fast or the patience is spent; excluded peers' groups are not priced."""
    plan, near_cd = two_group_plan(), client_links(far_rtt=0.080, near_rtt=0.002)
    moving = [r if r.peer_id != pid("D") else rec("D", 1, 4) for r in records()]  # the near group C-D still moves
    priced = price_groups([plan], moving, SHAPE, client_id=ME, local=near_cd, only_live=False)
    assert [p.spans[0][0] for p in priced] == [pid("C"), pid("A")]
    assert choose_group(priced, moving, waited=1.0, patience=30.0) is None
    assert choose_group(priced, moving, waited=30.0, patience=30.0).spans[0][0] == pid("A")
    assert choose_group(priced, moving, waited=1.0, patience=30.0, tolerance=100.0).spans[0][0] == pid("A")
    assert choose_group(priced, records(), waited=0.0, patience=30.0).spans[0][0] == pid("C")  # it moved
    assert choose_group(priced, [r for r in moving if r.peer_id != pid("A")], waited=99, patience=1) is None
    without_c = price_groups([plan], moving, SHAPE, client_id=ME, local=near_cd, only_live=False,
                             excluded={pid("C")})
    assert [p.spans[0][0] for p in without_c] == [pid("A")]
    assert choose_group(without_c, moving, excluded={pid("C")}, waited=0.0, patience=30.0).spans[0][0] == pid("A")


def test_router_routes_along_the_plan_and_falls_back_to_dijkstra():
    recs = records() + [rec("E", 0, 4)]  # E alone serves everything: Dijkstra's one-hop choice

    async def fetch():
        return recs

    async def plans():
        return [two_group_plan()]

    async def none():
        return []

    async def route(fetch_plans):
        router = Router(fetch, model=MODEL, fetch_plans=fetch_plans, shape=SHAPE, client_id=ME)
        router.links = client_links(far_rtt=0.080, near_rtt=0.002)
        for _ in range(3):
            router.links.observe(pid("E"), 0.001, 0.0, 100)
        return await router.make_chain(0, 4)

    assert asyncio.run(route(plans)) == [Hop(pid("C"), 0, 2), Hop(pid("D"), 2, 4)]
    assert asyncio.run(route(none)) == [Hop(pid("E"), 0, 4)]
