"""The graph cut planner on ResNet-50 (issue 18): planning time, and the cut it chose vs an equal split, as JSON.

    python benchmarks/opdag_plan.py [--arch resnet50] [--batch 8] [--image_size 224] [--tflops 0.5,1,0.5] [--mbit 1000]

Pure (no network): the graph is traced, each node's FLOPs and bytes counted (``peers.model.graph.costs``), and cut
for a chain of peers of ``--tflops`` TFLOP/s each (memory bandwidth 40 GB/s per TFLOP/s; the default is CPU-like),
the links ``--mbit`` Mbit/s, by ``swarm.plan.graph_cut.plan_graph_cut``; the baseline is ``equal_split`` (as many
nodes per stage). Reported: node count, counting and planning seconds (best of 5 plans, process CPU time), both
cuts with their stage and transfer seconds per batch and the bottleneck.
"""

from __future__ import annotations

import argparse
import json
import time

from peers.model.graph import get_architecture, trace_architecture
from peers.model.graph.costs import graph_costs
from swarm.plan.graph_cut import GraphCut, equal_split, evaluate_cuts, node_seconds_from_work, plan_graph_cut


def _as_json(cut: GraphCut, order: tuple[str, ...]) -> dict[str, object]:
    return {"cuts": list(cut.cuts), "cut_before": [order[c] for c in cut.cuts], "bottleneck_s": cut.bottleneck,
            "stage_s": list(cut.stage_seconds), "transfer_s": list(cut.transfer_seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--tflops", default="0.5,1,0.5")
    parser.add_argument("--mbit", type=float, default=1000.0)
    args = parser.parse_args()
    inputs = {"batch": args.batch, "image_size": args.image_size}
    graph = trace_architecture(args.arch, {}, inputs)
    start = time.process_time()
    costs = graph_costs(graph, get_architecture(args.arch).example_inputs(inputs))
    count_s = time.process_time() - start
    peers = [(float(t) * 1e12, float(t) * 40e9) for t in args.tflops.split(",")]
    seconds = node_seconds_from_work(costs.flops, costs.bytes_moved, peers)
    bandwidths = [args.mbit * 1e6 / 8] * (len(peers) - 1)
    plan_s = []
    for _ in range(5):
        start = time.process_time()
        plan = plan_graph_cut(seconds, costs.cut_bytes, bandwidths, costs.allowed)
        plan_s.append(time.process_time() - start)
    equal_cuts = equal_split(len(graph.order), len(peers), costs.allowed)
    equal = evaluate_cuts(seconds, costs.cut_bytes, bandwidths, equal_cuts)
    print(json.dumps({"arch": args.arch, "inputs": inputs, "nodes": len(graph.order), "gflops": sum(costs.flops) / 1e9,
                      "count_cpu_s": round(count_s, 3), "plan_cpu_s": round(min(plan_s), 4), "tflops": args.tflops,
                      "link_mbit": args.mbit, "planner": _as_json(plan, graph.order),
                      "equal_split": _as_json(equal, graph.order),
                      "speedup_vs_equal": round(equal.bottleneck / plan.bottleneck, 3)}))


if __name__ == "__main__":
    main()
