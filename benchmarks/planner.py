"""The planner's speed and plans on synthetic swarms, as JSON (pure: no network, no model).

    python benchmarks/planner.py [--sizes 1000,10000] [--regimes cpu,gpu] [--repeats 3] [--blocks 80] [--seed 0]

For each regime and size: a seeded synthetic swarm (``swarm.plan.synthetic``: 4 sites of 10 Gbit/s, 1 Gbit/s,
100 Mbit/s and 20 Mbit/s links inside, 50 Mbit/s between, each peer measuring 8 links, 10 % of them to other sites;
memory 2 blocks to the whole model) of a model of 80 blocks, hidden 8192, fp16; compute per token per block forward
1-20 ms ("cpu": compute-bound) or 0.02-0.4 ms ("gpu": links matter). Reported: wall and CPU seconds of
``make_plan`` (fresh; best and median of ``--repeats``; the CPU time is the process's, honest on a shared
machine), of a replan of the unchanged swarm with the plan in force, and of a replan after 1 % churn (1 %
of the peers leave, as many join), with the peers that moved and ``should_adopt``'s verdict; the plan's groups,
backups, tokens/s, and the share of groups on one site; and a naive baseline for the same swarm (peers in id order
cut into groups by memory alone, each cut optimally), and the compute-only bound (every peer's speed, perfectly
balanced, no memory limit, no links).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from rich.progress import Progress

from swarm.estimator import ModelShape
from swarm.plan import CostModel, Plan, PlanPeer, make_plan, partition, should_adopt
from swarm.plan.synthetic import peer_id, synthetic_swarm


def moved(before: Plan, after: Plan) -> int:
    return sum(before.place_of(p) != after.place_of(p) for p in set(before.peers) | set(after.peers))


def naive(peers: list[PlanPeer], num_blocks: int, links, cost: CostModel) -> float:
    """Peers in id order, a new group each time the memory holds the model; each group cut optimally in that order."""
    total, group, held = 0.0, [], 0
    for peer in sorted(peers, key=lambda p: p.peer_id):
        group.append(peer)
        held += min(peer.max_blocks, num_blocks)
        if held >= num_blocks:
            cut = partition(group, num_blocks, links, cost)
            total += 1.0 / cut.seconds_per_token if cut is not None else 0.0
            group, held = [], 0
    return total


REGIMES = {"cpu": (0.001, 0.02), "gpu": (0.00002, 0.0004)}  # forward seconds per token per block


def one_size(regime: str, n: int, num_blocks: int, repeats: int, seed: int, progress: Progress) -> dict:
    task = progress.add_task(f"{regime}: {n} peers", total=repeats + 3)
    shape = ModelShape(hidden_size=8192, num_blocks=num_blocks, dtype_bytes=2)
    swarm = synthetic_swarm(n, num_blocks, seed=seed, forward=REGIMES[regime])
    peers = list(swarm.peers)

    def plan(peers: list[PlanPeer], current: Plan | None = None, version: int = 1) -> tuple[Plan, float]:
        start = time.perf_counter()
        result = make_plan(peers, num_blocks, swarm.links, shape=shape, model="bench", version=version,
                           current=current)
        return result, time.perf_counter() - start

    times, cpu = [], []
    for _ in range(repeats):
        started = time.process_time()
        first, seconds = plan(peers)
        cpu.append(time.process_time() - started)
        times.append(seconds)
        progress.advance(task)
    again, again_s = plan(peers, first, 2)
    progress.advance(task)
    rng = random.Random(seed + 1)
    leaving = set(rng.sample([p.peer_id for p in peers], n // 100))
    low, high = REGIMES[regime]
    joining = [PlanPeer(peer_id(n + i), low * (high / low) ** rng.random(), 2 * high, rng.randint(2, num_blocks))
               for i in range(n // 100)]
    churned = [p for p in peers if p.peer_id not in leaving] + joining
    after, churn_s = plan(churned, first, 3)
    progress.advance(task)
    cost = CostModel(shape)
    baseline = naive(peers, num_blocks, swarm.links, cost)
    progress.advance(task)
    sizes = [len(g.stages) for g in first.groups]
    on_one_site = sum(len({swarm.site_of[s.peer_id] for s in g.stages}) == 1 for g in first.groups)
    bound = sum(1.0 / (num_blocks * cost.block_s(p)) for p in peers)
    return {
        "regime": regime, "peers": n, "blocks": num_blocks, "plan_s_best": min(times),
        "plan_s_median": statistics.median(times), "plan_cpu_s_best": min(cpu),
        "replan_unchanged_s": again_s, "replan_unchanged_moved": moved(first, again),
        "replan_churn_1pct_s": churn_s, "churn_moved_besides_leavers_and_joiners": moved(first, after) - 2 * (n // 100),
        "churn_should_adopt": should_adopt(first, after, churned, swarm.links, shape=shape),
        "groups": len(first.groups), "backups": len(first.backups), "tokens_per_s": first.tokens_per_s,
        "group_size_min_median_max": [min(sizes), statistics.median(sizes), max(sizes)],
        "groups_on_one_site": on_one_site / len(first.groups),
        "naive_tokens_per_s": baseline, "vs_naive": first.tokens_per_s / baseline if baseline else None,
        "compute_bound_tokens_per_s": bound, "of_compute_bound": first.tokens_per_s / bound,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000")
    parser.add_argument("--regimes", default="cpu,gpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=80)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    results = []
    with Progress(transient=True) as progress:
        for regime in args.regimes.split(","):
            for n in (int(s) for s in args.sizes.split(",")):
                results.append(one_size(regime, n, args.blocks, args.repeats, args.seed, progress))
    print(json.dumps({"benchmark": "planner", "results": results}, indent=2))


if __name__ == "__main__":
    main()
