"""The simulated broker: a departure takes a group down; a backup takes the span over after detection, a plan
period and loading its weights; throughput equals the planner's bound when nothing fails; a seed repeats a run."""

from __future__ import annotations

import random

import pytest

from swarm.simulation.broker import SimBroker
from swarm.simulation.churn import Churn
from swarm.simulation.devices import MODELS
from swarm.simulation.events import EventLoop
from swarm.simulation.measured import KnownLinks
from swarm.simulation.metrics import Metrics
from swarm.simulation.network import link
from swarm.simulation.population import Kind, Population
from swarm.simulation.run import SimConfig, simulate

MODEL = MODELS["llama-2-13b"]
HOME_3080 = (Kind("rtx3080", 1),)


def _swarm(count: int, detect_s: float = 31.0, plan_period_s: float = 15.0):
    population = Population(random.Random(7), MODEL, HOME_3080, regions=("eu",))
    peers = [population.draw() for _ in range(count)]
    loop, metrics = EventLoop(), Metrics()
    broker = SimBroker(loop, metrics, MODEL, KnownLinks(random.Random(1), link),
                       lambda a, b: link(broker.ever[a].host, broker.ever[b].host), detect_s=detect_s,
                       plan_period_s=plan_period_s)
    for peer in peers:
        broker.join(peer)
    return loop, metrics, broker


def test_a_backup_takes_over_after_detection_a_plan_period_and_loading():
    loop, metrics, broker = _swarm(7, detect_s=31.0, plan_period_s=15.0)
    plan = broker.replan(warm=True)
    assert len(plan.groups) == 1 and plan.backups, "7 RTX 3080s (12 blocks each) make one 40-block group"
    before = metrics.achieved
    assert before == pytest.approx(plan.tokens_per_s)
    victim = plan.groups[0].stages[1]
    loop.at(100.0, lambda: broker.leave(victim.peer_id))
    loop.run(101.0)
    assert metrics.achieved == 0.0  # the only group is down
    loop.run(20_000.0)
    assert broker.plan is not None
    new = next(s for s in broker.plan.groups[0].stages if s.span == victim.span)
    assert new.peer_id in plan.backups
    load = broker.ever[new.peer_id].load_s(victim.end - victim.start, MODEL)
    (recovery,) = metrics.recoveries
    assert recovery.how == "backup"
    assert recovery.seconds == pytest.approx(31.0 + 15.0 + load)
    assert metrics.achieved > 0 and metrics.moves == 1
    assert metrics.achieved == pytest.approx(broker.plan.groups[0].tokens_per_s)  # all its links are measured


def test_without_a_fitting_backup_the_group_waits_for_a_re_plan():
    loop, metrics, broker = _swarm(4)
    plan = broker.replan(warm=True)
    assert len(plan.groups) == 1 and not plan.backups
    loop.at(10.0, lambda: broker.leave(plan.groups[0].stages[0].peer_id))
    loop.run(10_000.0)
    assert metrics.achieved == 0.0 and metrics.recoveries[0].end is None
    assert broker.replan_free() is not None  # the 3 survivors cannot hold 40 blocks: the group is dissolved
    assert broker.plan is not None and not broker.plan.groups and len(broker.plan.backups) == 3


@pytest.mark.parametrize("mix", [HOME_3080, (Kind("h100", 1, datacenter=True),)])
def test_throughput_equals_the_bound_when_nothing_fails(mix):
    result = simulate(SimConfig(peers=6, mix=mix, regions=("eu",), datacenter_rate=100e9, duration_s=600,
                                replan_s=120))
    summary = result.metrics.summary()
    assert summary["achieved_mean_tokens_per_s"] == pytest.approx(result.first_plan.tokens_per_s)
    assert summary["achieved_over_bound"] == pytest.approx(1.0)
    assert summary["recoveries"] == 0 and summary["moves_per_hour"] == 0


def test_a_seed_repeats_a_run_and_another_seed_does_not():
    def run(seed: int):
        config = SimConfig(peers=40, duration_s=1800, replan_s=120, churn=Churn(60, 60), seed=seed)
        result = simulate(config)
        return (result.metrics.series(), [(r.start, r.end, r.how) for r in result.metrics.recoveries],
                result.joined, result.left, result.metrics.moves)

    first = run(3)
    assert first[2] > 0 and first[3] > 0
    assert run(3) == first
    assert run(4) != first


def test_an_incremental_re_plan_groups_joiners_and_keeps_the_running_group():
    loop, metrics, broker = _swarm(4)
    plan = broker.replan(warm=True)
    (group,) = plan.groups
    rate = metrics.achieved
    population = Population(random.Random(8), MODEL, HOME_3080, regions=("eu",))
    for _ in range(4):
        broker.join(population.draw())
    assert broker.replan_free() is not None
    assert broker.plan is not None and len(broker.plan.groups) == 2
    assert group in broker.plan.groups  # untouched: it kept serving
    assert metrics.achieved == pytest.approx(rate)  # the new group is loading its spans
    loop.run(10_000.0)
    assert metrics.achieved > rate and metrics.moves == 4 and metrics.takeovers == 0
