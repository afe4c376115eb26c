"""Operator-graph training through the swarm (issue 18): images/s of a ResNet cut into 3 stages on 3 graph peers
(``swarm peer --graph ARCH --graph_stage I/3``) trained by a ``GraphTrainer`` (star, two-phase steps, micro-batches in
flight), against the same steps in one process; and the cut the planner chose (``--graph_split plan``) against an
equal split by node count (``equal``), in the same run. Prints one JSON line.

    python benchmarks/opdag.py --arch resnet50 --batch 8 --image_size 64 --steps 4

On loopback (one machine; ``--threads`` per process) the peers share its cores: the figure says what the swarm
path costs (encryption, framing, the star's round trips, the pipeline's fill and drain), not a speed-up.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from peers.cli.launch import LocalSwarm
from peers.model.graph.swarm_graph import GraphSpec
from peers.trainer.graph_trainer import GraphTrainer


def _batches(args: argparse.Namespace, seed: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    return [[(torch.randn(args.batch, 3, args.image_size, args.image_size, generator=gen),
              torch.randint(0, args.classes, (args.batch,), generator=gen)) for _ in range(args.micro)]
            for _ in range(args.steps + 1)]


def one_process(spec: GraphSpec, args: argparse.Namespace) -> float:
    torch.set_num_threads(args.threads)
    model = copy.deepcopy(spec.trace().gm).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = _batches(args, 0)
    began = 0.0
    for i, micro in enumerate(steps):
        if i == 1:
            began = time.perf_counter()  # the first step warms up
        for x, y in micro:
            (F.cross_entropy(model(x), y) / len(micro)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return args.steps * args.micro * args.batch / (time.perf_counter() - began)


def through_swarm(spec: GraphSpec, args: argparse.Namespace, split: str, workdir: Path) -> dict[str, object]:
    flags = ["--graph_config", f"num_classes={args.classes}", "--graph_inputs",
             f"batch={args.batch},image_size={args.image_size}", "--graph_split", split]
    with LocalSwarm(workdir / split, update_period=2.0, num_threads=args.threads, train=True) as swarm:
        swarm.start_dht()
        procs = [swarm.start_graph_peer(spec.arch, stage=f"{i}/3", extra=flags, wait=False) for i in range(3)]
        ranges = [swarm.wait_graph_ready(p, timeout=300)[:2] for p in procs]
        with GraphTrainer(spec, swarm.trainer_config(), run_id=f"bench-{split}", in_flight=args.in_flight,
                          request_timeout=120) as trainer:
            trainer.start()
            steps = _batches(args, 0)
            began = 0.0
            for i, micro in enumerate(steps):
                if i == 1:
                    began = time.perf_counter()
                trainer.train_step(micro)
            rate = args.steps * args.micro * args.batch / (time.perf_counter() - began)
    return {"images_per_s": round(rate, 2), "stages": [f"{a}:{b}" for a, b in ranges]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8, help="images per micro-batch")
    parser.add_argument("--image_size", type=int, default=64)
    parser.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--in_flight", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parser.parse_args()
    spec = GraphSpec(args.arch, {"num_classes": args.classes}, {"batch": args.batch, "image_size": args.image_size})
    local = one_process(spec, args)
    with tempfile.TemporaryDirectory(prefix="opdag-") as tmp:
        plan = through_swarm(spec, args, "plan", Path(tmp))
        equal = through_swarm(spec, args, "equal", Path(tmp))
    print(json.dumps({"arch": args.arch, "batch": args.batch, "image_size": args.image_size, "micro": args.micro,
                      "in_flight": args.in_flight, "steps": args.steps, "threads": args.threads,
                      "one_process_images_per_s": round(local, 2), "swarm_plan": plan, "swarm_equal": equal,
                      "plan_vs_one_process": round(float(plan["images_per_s"]) / local, 3),  # type: ignore[arg-type]
                      "plan_vs_equal": round(float(plan["images_per_s"]) / float(equal["images_per_s"]), 3)}))  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
