"""A broker's plan over time: made once, kept while nothing clearly better appears, replaced (version + 1) when a
peer of a group fails."""

from __future__ import annotations

from swarm.estimator import ModelShape
from swarm.plan.broker import next_plan
from swarm.records import PeerRecord, PeerState

MODEL = "llama-tiny"
SHAPE = ModelShape(hidden_size=64, num_blocks=4)
ME = "12D3KooW" + "T" * 44


def pid(name: str) -> str:
    return "12D3KooW" + name * 44


def rec(name: str, start: int, end: int, state: PeerState = PeerState.ONLINE) -> PeerRecord:
    return PeerRecord(peer_id=pid(name), model=MODEL, start=start, end=end, state=state, throughput=0.0,
                      forward_seconds=1e-4, backward_seconds=2e-4, max_blocks=4)


RECORDS = [rec("A", 0, 1), rec("B", 1, 2), rec("C", 0, 1), rec("D", 3, 4, PeerState.BACKUP)]


def make(current=None, excluded=(), now=1.0, first_version=0):
    return next_plan(RECORDS, current, shape=SHAPE, model=MODEL, objective="training", broker=ME, now=now,
                     first_version=first_version, run_id="run-1", excluded=excluded)


def test_first_plan_then_kept_then_replaced_without_a_failed_peer():
    first = make(first_version=5)
    assert first.version == 5 and first.run_id == "run-1" and first.broker == ME and first.groups
    assert sorted(first.peers) == sorted(pid(n) for n in "ABCD")  # every peer placed: a stage or a backup
    again = make(first, now=2.0)
    assert again.version == 5 and again.groups == first.groups and again.made_at == 2.0
    failed = first.groups[0].stages[0].peer_id
    replaced = make(first, excluded={failed}, now=3.0)
    assert replaced.version == 6 and failed not in replaced.peers
    assert all(g.num_blocks == 4 for g in replaced.groups) and replaced.groups
