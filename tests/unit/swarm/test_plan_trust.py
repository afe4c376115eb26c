"""Which plan a peer follows: the private swarm's broker election, trainers' runs, versions."""

from __future__ import annotations

from swarm.plan.trust import next_version, pick_plan, swarm_broker, trusted_plans
from swarm.plan.types import Assignment, Group, Plan
from swarm.records import PeerRecord, PeerState

MODEL = "llama-tiny"


def pid(name: str) -> str:
    return "12D3KooW" + name * 44


def rec(name: str, state: PeerState = PeerState.ONLINE) -> PeerRecord:
    return PeerRecord(peer_id=pid(name), model=MODEL, start=0, end=4, state=state, throughput=10.0)


def plan(broker: str, version: int = 1, run_id: str = "", made_at: float = 100.0) -> Plan:
    group = Group((Assignment(pid("A"), 0, 4),), seconds_per_token=0.01)
    return Plan(model=MODEL, num_blocks=4, version=version, groups=(group,), broker=pid(broker), run_id=run_id,
                made_at=made_at)


def nobody(_: str) -> bool:
    return False


def test_swarm_broker_is_the_smallest_live_peer_id():
    assert swarm_broker([rec("C"), rec("B"), rec("D")]) == pid("B")
    assert swarm_broker([rec("C"), rec("B", PeerState.OFFLINE), rec("D", PeerState.JOINING)]) == pid("C")
    assert swarm_broker([rec("B", PeerState.BACKUP), rec("C")]) == pid("B")
    assert swarm_broker([rec("B", PeerState.OFFLINE)]) is None
    assert swarm_broker([]) is None


def test_swarm_wide_plans_only_from_the_elected_broker_and_only_in_a_private_swarm():
    records = [rec("B"), rec("C"), rec("D")]
    plans = [plan("B", 1), plan("C", 5), plan("Z", 9)]  # C and Z (not even a peer) claim to be brokers too
    assert trusted_plans(plans, records, private=True, may_train=nobody) == [plan("B", 1)]
    assert trusted_plans(plans, records, private=False, may_train=nobody) == []  # public: no broker
    # B leaves: C is elected by everyone, and its plan is followed
    left = [rec("B", PeerState.OFFLINE), rec("C"), rec("D")]
    assert pick_plan(plans, left, private=True, may_train=nobody, current=plan("B", 1),
                     followed={(pid("B"), ""): 1}) == plan("C", 5)


def test_runs_need_the_trainer_allowed_and_win_over_the_swarm_plan():
    records = [rec("B"), rec("C")]
    run = plan("T", 1, run_id="run-1")
    plans = [plan("B", 3), run]
    assert pick_plan(plans, records, private=True, may_train=lambda p: p == pid("T"), current=None) == run
    assert pick_plan(plans, records, private=True, may_train=nobody, current=None) == plan("B", 3)
    assert pick_plan([run], records, private=False, may_train=nobody, current=None) is None
    assert pick_plan([run], records, private=False, may_train=lambda p: True, current=None) == run


def test_older_versions_are_ignored_and_the_followed_run_stays():
    records = [rec("B")]
    anyone = lambda _: True  # noqa: E731
    current = plan("T", 4, run_id="r")
    followed = {(pid("T"), "r"): 4}
    stale = plan("T", 3, run_id="r")
    assert pick_plan([stale], records, private=False, may_train=anyone, current=current, followed=followed) is None
    assert pick_plan([current], records, private=False, may_train=anyone, current=current,
                     followed=followed) == current  # the same plan, republished: still followed
    newer = plan("T", 5, run_id="r")
    other = plan("U", 1, run_id="s", made_at=999.0)  # a newer run of another allowed trainer
    assert pick_plan([newer, other], records, private=False, may_train=anyone, current=current,
                     followed=followed) == newer
    assert pick_plan([other, stale], records, private=False, may_train=anyone, current=current,
                     followed=followed) == other  # T's run is gone (only a stale copy): the other run


def test_next_version_continues_after_the_highest_seen():
    assert next_version([]) == 0
    assert next_version([plan("B", 4), plan("C", 7), plan("T", 50, run_id="r")]) == 8
    assert next_version([plan("T", 50, run_id="r")], "r") == 51
