"""The trainer of benchmarks/opdag.py: a ``GraphTrainer`` run, timed (in-process on loopback, or as this script
inside the trainer's testbed host).

    python benchmarks/opdag_worker.py SPEC.json OUT.json

SPEC names the graph (``arch``, ``classes``, ``batch``, ``image_size``), the swarm (``initial_peers``, this host's
``address``, the trainer's ``identity_path``), the run id and the steps (``micro``, ``in_flight``, ``steps``,
``threads``). It trains one warm-up step and ``steps`` timed ones on the same seeded batches every arrangement gets
and writes images/s, each step's seconds and the losses.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from peers.core.config import SwarmConfig
from peers.model.graph.swarm_graph import GraphSpec
from peers.trainer.graph_trainer import GraphTrainer


def graph_spec(spec: dict) -> GraphSpec:
    return GraphSpec(spec["arch"], {"num_classes": spec["classes"]},
                     {"batch": spec["batch"], "image_size": spec["image_size"]})


def batches(spec: dict, seed: int = 0) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``steps + 1`` steps of ``micro`` micro-batches of random images and labels (the first step warms up)."""
    gen = torch.Generator().manual_seed(seed)
    size = spec["image_size"]
    return [[(torch.randn(spec["batch"], 3, size, size, generator=gen),
              torch.randint(0, spec["classes"], (spec["batch"],), generator=gen)) for _ in range(spec["micro"])]
            for _ in range(spec["steps"] + 1)]


def train(trainer: GraphTrainer, spec: dict) -> dict:
    """Warm-up step, then the timed ones."""
    trainer.start()
    seconds, losses = [], []
    for micro in batches(spec):
        began = time.perf_counter()
        losses.append(round(float(torch.stack(trainer.train_step(micro)).mean()), 5))
        seconds.append(round(time.perf_counter() - began, 3))
    images = spec["steps"] * spec["micro"] * spec["batch"]
    return {"images_per_s": round(images / sum(seconds[1:]), 3), "step_seconds": seconds, "losses": losses}


def main() -> None:
    spec_path, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    spec = json.loads(spec_path.read_text())
    torch.set_num_threads(spec["threads"])
    swarm = SwarmConfig(initial_peers=tuple(spec["initial_peers"]), identity_path=spec["identity_path"],
                        host_maddrs=(f"/ip4/{spec['address']}/tcp/0",))
    with GraphTrainer(graph_spec(spec), swarm, run_id=spec["run_id"], in_flight=spec["in_flight"],
                      request_timeout=300, wait_peers=300) as trainer:
        out_path.write_text(json.dumps(train(trainer, spec)))


if __name__ == "__main__":
    main()
