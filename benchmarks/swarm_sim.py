"""Swarm-scale simulation (swarm.simulation): the real planner and broker logic over a simulated population.

    python benchmarks/swarm_sim.py [--case fusionai,swarm] [--model llama-2-13b] [--seed 0] [--out FILE]

1. ``fusionai``: FusionAI's claim that 50 RTX 3080s match 4 H100s. 50 RTX 3080 (10 GB) at homes in one region
   (50-1000 Mbit/s down, 10-100 up, 10-70 ms round trips) against 4 H100 SXM (80 GB) in one datacenter (100 Gbit/s
   NICs). Our planner makes each swarm's plan for training (fp16 weights, adapters on frozen weights: 2 bytes per
   weight; and full training with Adam: 16 bytes per weight) and inference; each training group is also priced by
   the estimator (``swarm.estimator.estimate_training``, chain data path, one step of ``--micro_batches`` micro-batches
   of 1024 tokens, 8 in flight, fill, drain and commit included; the trainer on fast links). Then an hour of churn
   on the home swarm (``--fusion_joins_per_hour``, ``--fusion_leaves_per_hour``); the datacenter has none.
2. ``swarm``: ``--peers`` heterogeneous peers (``swarm.simulation.population.HETEROGENEOUS``) in three regions for
   ``--duration_s`` with churn (``--joins_per_hour``, ``--leaves_per_hour``): throughput against the bound over time,
   recoveries, moves, planner seconds. The planner runs on every peer every ``--full_replan_s`` (the bound) and on
   the free peers (backups, joiners, survivors of broken groups) every ``--replan_s``.

Prints one JSON object (progress on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from swarm.estimator import CLIENT, Compute, Link, ModelShape, Pipeline, Stage, estimate_training
from swarm.plan.types import Plan
from swarm.simulation import CATALOG, MODELS, Churn, Kind, SimConfig, SimResult, simulate
from swarm.simulation.network import GBIT, link

console = Console(stderr=True)
FAST_CLIENT = Link.from_rtt(10 * GBIT, 0.001)  # the trainer's own links: not what is compared here


def run(config: SimConfig, label: str) -> SimResult:
    with Progress(TextColumn(f"[bold]{label}"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total:.0f} s"),
                  TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task(label, total=config.duration_s)
        result = simulate(config, progress=lambda now: progress.update(task, completed=now))
        progress.update(task, completed=config.duration_s)
        return result


def estimator_rate(result: SimResult, plan: Plan, micro_batches: int) -> float:
    """The estimator's training tokens/s of ``plan``'s groups (summed), on the simulated network's true links."""
    model = MODELS[result.config.model]
    shape = ModelShape(model.hidden_size, model.num_blocks, model.dtype_bytes)
    total = 0.0
    for group in plan.groups:
        peers = [result.broker.ever[s.peer_id] for s in group.stages]
        stages = tuple(Stage(p.peer_id, s.start, s.end, Compute(p.figures.forward_s, p.figures.backward_s))
                       for p, s in zip(peers, group.stages, strict=True))
        links = {}
        for p in peers:
            links[(CLIENT, p.peer_id)] = links[(p.peer_id, CLIENT)] = FAST_CLIENT
        for a, b in zip(peers, peers[1:], strict=False):
            links[(a.peer_id, b.peer_id)] = Link.from_rtt(*link(a.host, b.host))
            links[(b.peer_id, a.peer_id)] = Link.from_rtt(*link(b.host, a.host))
        pipeline = Pipeline(stages, links, topology="chain")
        total += estimate_training(shape, pipeline, rows=8, seq_len=128, micro_batches=micro_batches,
                                   in_flight=8).tokens_per_s
    return total


def describe(result: SimResult, plan: Plan, estimate: bool, micro_batches: int) -> dict[str, object]:
    out: dict[str, object] = {
        "tokens_per_s": plan.tokens_per_s, "groups": len(plan.groups),
        "stages_per_group": sorted({len(g.stages) for g in plan.groups}),
        "group_tokens_per_s": [round(g.tokens_per_s, 1) for g in plan.groups], "backups": len(plan.backups),
        "plan_s": result.metrics.plan_seconds[0],
    }
    if estimate:
        out["estimator_tokens_per_s"] = estimator_rate(result, plan, micro_batches)
    return out


def fusionai(args: argparse.Namespace) -> dict[str, object]:
    swarms = {
        "rtx3080_x50_home": dict(peers=50, mix=(Kind("rtx3080", 1),)),
        "h100_x4_datacenter": dict(peers=4, mix=(Kind("h100", 1, datacenter=True),)),
    }
    out: dict[str, object] = {"model": args.model, "utilisation": CATALOG["rtx3080"].utilisation}
    for name, swarm in swarms.items():
        row: dict[str, object] = {}
        for label, objective, memory in (("training_adapters", "training", "adapters"),
                                         ("training_full_adam", "training", "full"),
                                         ("inference", "inference", "inference")):
            config = SimConfig(model=args.model, memory=memory, objective=objective, regions=("eu",),
                               datacenter_rate=100 * GBIT, duration_s=60.0, replan_s=60.0, seed=args.seed,
                               **swarm)  # type: ignore[arg-type]
            result = run(config, f"{name} {label}")
            row[label] = describe(result, result.first_plan, objective == "training", args.micro_batches)
        out[name] = row
    home, dc = out["rtx3080_x50_home"], out["h100_x4_datacenter"]
    assert isinstance(home, dict) and isinstance(dc, dict)
    out["ratio_3080s_over_h100s"] = {label: home[label]["tokens_per_s"] / dc[label]["tokens_per_s"]
                                     for label in home}
    out["ratio_3080s_over_h100s_estimator"] = {
        label: home[label]["estimator_tokens_per_s"] / dc[label]["estimator_tokens_per_s"]
        for label in home if "estimator_tokens_per_s" in home[label]}
    out["ratio_peak_flops"] = 50 * CATALOG["rtx3080"].peak_flops / (4 * CATALOG["h100"].peak_flops)
    churn = Churn(args.fusion_joins_per_hour, args.fusion_leaves_per_hour)
    config = SimConfig(model=args.model, memory="adapters", objective="training", regions=("eu",),
                       duration_s=args.fusion_duration_s, replan_s=args.replan_s, churn=churn, seed=args.seed,
                       **swarms["rtx3080_x50_home"])  # type: ignore[arg-type]
    result = run(config, "rtx3080_x50_home with churn")
    summary = result.metrics.summary()
    summary.update(joined=result.joined, left=result.left, churn=asdict(churn))
    out["rtx3080_x50_home_with_churn"] = summary
    dc_rate = dc["training_adapters"]["tokens_per_s"]
    out["ratio_with_churn_training_adapters"] = summary["achieved_mean_tokens_per_s"] / dc_rate  # type: ignore
    return out


def swarm(args: argparse.Namespace) -> dict[str, object]:
    churn = Churn(args.joins_per_hour, args.leaves_per_hour)
    config = SimConfig(model=args.model, memory="adapters", objective="training", peers=args.peers,
                       duration_s=args.duration_s, replan_s=args.replan_s, full_replan_s=args.full_replan_s,
                       churn=churn, seed=args.seed, bucket_s=args.bucket_s)
    started = time.perf_counter()
    result = run(config, f"{args.peers} peers")
    metrics = result.metrics
    summary = metrics.summary()
    sizes, seconds = metrics.plan_sizes, metrics.plan_seconds
    full = [(n, s) for n, s in zip(sizes, seconds, strict=True) if n > args.peers // 2]
    free = [(n, s) for n, s in zip(sizes, seconds, strict=True) if n <= args.peers // 2]
    first = result.first_plan
    summary.update(
        peers=args.peers, joined=result.joined, left=result.left, churn=asdict(churn), wall_s=time.perf_counter()
        - started, first_plan={"tokens_per_s": first.tokens_per_s, "groups": len(first.groups),
                               "stages_per_group_max": max((len(g.stages) for g in first.groups), default=0),
                               "single_stage_groups": sum(len(g.stages) == 1 for g in first.groups),
                               "backups": len(first.backups)},
        full_replans={"count": len(full), "peers": [n for n, _ in full], "seconds": [round(s, 2) for _, s in full]},
        incremental_replans={"count": len(free), "peers_max": max((n for n, _ in free), default=0),
                             "seconds_max": max((s for _, s in free), default=0.0),
                             "seconds_total": sum(s for _, s in free)},
        series=[{k: round(v, 1) if k != "ratio" else round(v, 4) for k, v in row.items()} for row in metrics.series()],
    )
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default="fusionai,swarm")
    parser.add_argument("--model", default="llama-2-13b", choices=sorted(MODELS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--micro_batches", type=int, default=32)
    parser.add_argument("--fusion_duration_s", type=float, default=3600.0)
    parser.add_argument("--fusion_joins_per_hour", type=float, default=10.0)
    parser.add_argument("--fusion_leaves_per_hour", type=float, default=10.0)
    parser.add_argument("--peers", type=int, default=10_000)
    parser.add_argument("--duration_s", type=float, default=3600.0)
    parser.add_argument("--joins_per_hour", type=float, default=5000.0)
    parser.add_argument("--leaves_per_hour", type=float, default=5000.0)
    parser.add_argument("--replan_s", type=float, default=60.0)
    parser.add_argument("--full_replan_s", type=float, default=1800.0)
    parser.add_argument("--bucket_s", type=float, default=300.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cases = {c.strip() for c in args.case.split(",") if c.strip()}
    unknown = cases - {"fusionai", "swarm"}
    if unknown:
        sys.exit(f"unknown case(s) {sorted(unknown)}: choose from fusionai, swarm")
    out: dict[str, object] = {"args": vars(args)}
    if "fusionai" in cases:
        out["fusionai"] = fusionai(args)
    if "swarm" in cases:
        out["swarm"] = swarm(args)
    text = json.dumps(out, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
