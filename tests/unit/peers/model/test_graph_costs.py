"""The planner's inputs from a traced graph (issue 18): FLOPs per node, bytes per cut, and a plan of ResNet-50
for three peers that is no worse than an equal split by node count."""

from __future__ import annotations

import torch

from peers.model.graph import get_architecture
from peers.model.graph.costs import graph_costs
from swarm.plan.graph_cut import equal_split, evaluate_cuts, node_seconds_from_work, plan_graph_cut
from tests.unit.peers.model.conftest import RESNET_INPUTS


def test_resnet50_costs_and_plan(resnet50_graph):
    inputs = {"batch": 2, "image_size": 32}
    graph = resnet50_graph
    stats = graph.gm.bn1.running_mean.clone()
    costs = graph_costs(graph, get_architecture("resnet50").example_inputs(inputs))
    assert torch.equal(graph.gm.bn1.running_mean, stats)  # counting moved no BatchNorm statistics
    n = len(graph.order)
    conv1 = graph.order.index("conv1")
    assert costs.flops[conv1] == 2 * 2 * 64 * 16 * 16 * 3 * 7 * 7  # 2 * batch * out channels * out pixels * kernel
    assert costs.flops[graph.order.index("relu")] == 0 and costs.bytes_moved[graph.order.index("relu")] > 0
    for cut in (0, 5, 60, n):
        assert costs.cut_bytes[cut] == sum(s.nbytes for s in graph.specs(graph.crossing(cut)))
    peers = [(1e9, 1e9), (3e9, 3e9), (1e9, 1e9)]
    seconds = node_seconds_from_work(costs.flops, costs.bytes_moved, peers)
    plan = plan_graph_cut(seconds, costs.cut_bytes, [1e9, 1e9], costs.allowed)
    equal = evaluate_cuts(seconds, costs.cut_bytes, [1e9, 1e9], equal_split(n, 3, costs.allowed))
    assert plan.bottleneck < equal.bottleneck
    assert plan.stage_seconds[1] > plan.stage_seconds[0]  # the 3x faster middle peer carries the most
    total = sum(costs.param_bytes)
    assert total == sum(t.numel() * t.element_size() for t in graph.gm.state_dict().values())
    memory = [total / 2, total / 2, total / 2]  # no peer holds more than half of the weights
    capped = plan_graph_cut(seconds, costs.cut_bytes, [1e9, 1e9], costs.allowed, node_bytes=costs.param_bytes,
                            memory=memory)

    def most_held(cut):
        bounds = [0, *cut.cuts, n]
        return max(sum(costs.param_bytes[a:b]) for a, b in zip(bounds, bounds[1:], strict=False))

    assert most_held(plan) > total / 2 >= most_held(capped) and capped.bottleneck > plan.bottleneck


def test_stage_cuts_move_away_from_a_slow_link(resnet50_graph):
    """Protects: ``--graph_links``: a slow link into the last stage makes the planner cut where fewer bytes cross it
    (and the bottleneck it prices is no worse than the 1 Gbit/s plan's); a wrong number of links is refused."""
    import pytest

    from peers.model.graph.swarm_graph import PLAN_LINK, stage_cuts

    graph, inputs = resnet50_graph, get_architecture("resnet50").example_inputs(RESNET_INPUTS)
    costs = graph_costs(graph, inputs)
    slow = (PLAN_LINK, 1e6 / 8)  # 1 Gbit/s, then 1 Mbit/s into the last stage
    fast_cuts, slow_cuts = stage_cuts(graph, 3, "plan", inputs), stage_cuts(graph, 3, "plan", inputs, slow)
    assert costs.cut_bytes[slow_cuts[1]] < costs.cut_bytes[fast_cuts[1]]
    seconds = node_seconds_from_work(costs.flops, costs.bytes_moved, [(1e12, 40e9)] * 3)
    assert evaluate_cuts(seconds, costs.cut_bytes, list(slow), slow_cuts).bottleneck < \
        evaluate_cuts(seconds, costs.cut_bytes, list(slow), fast_cuts).bottleneck
    with pytest.raises(ValueError, match="3 stages need 2 positive link rates"):
        stage_cuts(graph, 3, "plan", inputs, (PLAN_LINK,))
