"""The plan follower: where a plan puts a peer (pure), and one round of the loop with in-memory records/plans."""

from __future__ import annotations

import asyncio

from peers.server.plan_follower import PlanFollower, decide
from swarm.plan.types import Assignment, Group, Plan
from swarm.records import PeerRecord, PeerState

MODEL = "llama-tiny"


def pid(name: str) -> str:
    return "12D3KooW" + name * 44


def rec(name: str, state: PeerState = PeerState.ONLINE) -> PeerRecord:
    return PeerRecord(peer_id=pid(name), model=MODEL, start=0, end=2, state=state, throughput=10.0)


def plan(broker: str = "B", version: int = 1, run_id: str = "") -> Plan:
    group = Group((Assignment(pid("A"), 0, 3), Assignment(pid("C"), 3, 4)), seconds_per_token=0.01)
    return Plan(model=MODEL, num_blocks=4, version=version, groups=(group,), backups=(pid("D"),),
                broker=pid(broker), run_id=run_id)


def test_decide():
    p = plan()
    assert decide(p, pid("A"), (0, 2)).action == "move"
    assert (decide(p, pid("A"), (0, 2)).start, decide(p, pid("A"), None).end) == (0, 3)
    assert decide(p, pid("A"), (0, 3)).action == "stay"
    assert decide(p, pid("D"), (0, 4)).action == "backup"
    assert decide(p, pid("D"), None).action == "stay"
    assert decide(p, pid("E"), (1, 2)).action == "stay"  # not in the plan: keeps its blocks
    assert decide(None, pid("A"), (0, 1)).action == "stay"


class FakeServer:
    def __init__(self, span):
        self.span, self.calls = span, []

    async def move_to(self, start: int, end: int) -> None:
        self.calls.append(("move", start, end))
        self.span = (start, end)

    async def become_backup(self) -> None:
        self.calls.append(("backup",))
        self.span = None


def follower(me: str, records, plans, *, private: bool, may_train=lambda _: False, broker=None):
    server = FakeServer((0, 2))
    published: list[Plan] = []

    async def fetch_records():
        return records

    async def fetch_plans():
        return list(plans)

    async def publish(p: Plan) -> bool:
        published.append(p)
        return True

    f = PlanFollower(server, pid(me), period=1.0, private=private, may_train=may_train, fetch_records=fetch_records,
                     fetch_plans=fetch_plans, publish=publish, broker=broker)
    return f, server, published


def test_member_follows_the_elected_brokers_plan_and_moves_once():
    records = [rec("A"), rec("B"), rec("C")]  # A is the smallest id: the broker
    f, server, _ = follower("C", records, [plan("A", 2), plan("B", 9)], private=True)
    assert asyncio.run(f.step()).action == "move"
    assert server.calls == [("move", 3, 4)]
    assert asyncio.run(f.step()).action == "stay"  # already there
    assert server.calls == [("move", 3, 4)]


def test_elected_broker_publishes_and_follows_its_own_plan():
    records = [rec("A"), rec("C")]
    made = []

    def broker(records, plans, last):
        made.append(last)
        return plan("A", 1)

    f, server, published = follower("A", records, [], private=True, broker=broker)
    asyncio.run(f.step())
    asyncio.run(f.step())
    assert published == [plan("A", 1)] * 2  # republished each period
    assert made == [None, plan("A", 1)]
    assert server.calls == [("move", 0, 3)]
    g, _, published = follower("C", records, [], private=True, broker=broker)  # not elected: does not publish
    asyncio.run(g.step())
    assert published == []


def test_public_peer_ignores_swarm_plans_and_follows_allowed_trainers_only():
    records = [rec("A"), rec("C")]
    f, server, _ = follower("D", records, [plan("A", 1)], private=False, may_train=lambda _: True)
    asyncio.run(f.step())
    assert server.calls == []
    run = plan("T", 1, run_id="r")
    f, server, _ = follower("D", records, [run], private=False, may_train=lambda p: p == pid("U"))
    asyncio.run(f.step())
    assert server.calls == []
    f, server, _ = follower("D", records, [run], private=False, may_train=lambda p: p == pid("T"))
    asyncio.run(f.step())
    assert server.calls == [("backup",)]
