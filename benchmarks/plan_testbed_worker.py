"""The trainer of benchmarks/plan_testbed.py, run inside the trainer's testbed host: one training run, timed.

    python benchmarks/plan_testbed_worker.py SPEC.json OUT.json

SPEC names the model folder, the initial peers, this host's address, the trainer's identity, the peers it may use
(``allowed``: the arrangement's pipeline, or every peer started for it), the run id (whose step-0 checkpoints the
peers hold) and the training parameters. The trainer picks its stages among the allowed peers as today
(``swarm.stages``: whole spans tiling the blocks, replicas of a span sharing the micro-batches), trains ``steps``
steps and writes each step's seconds, tokens, loss and the stages it ran on. tokens/s leaves out the first step
(it opens the run).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import open_run  # noqa: E402

from peers.client.swarm_client import SwarmClient  # noqa: E402
from peers.core.config import ClientConfig, SwarmConfig  # noqa: E402
from peers.trainer.swarm_trainer import SwarmTrainer  # noqa: E402
from peers.training import OptimConfig, TokenBatches, encode_bytes, read_corpus  # noqa: E402


def run(spec: dict) -> dict:
    tr = spec["train"]
    swarm = SwarmConfig(initial_peers=tuple(spec["initial_peers"]), host_maddrs=(f"/ip4/{spec['address']}/tcp/0",),
                        identity_path=spec["identity_path"])
    config = ClientConfig(swarm=swarm, allowed_peers=tuple(spec["allowed"]), request_timeout=120)
    batches = TokenBatches(encode_bytes(read_corpus()), tr["seq_len"], tr["micro_batch"], seed=tr["seed"])
    with SwarmClient(spec["model_dir"], config=config) as client:
        client.wait_for_records(spec["wait_records"], timeout=180)
        trainer = SwarmTrainer(client, OptimConfig(**tr["optim"]), tr["accumulation"], in_flight=tr["in_flight"],
                               run_id=spec["run_id"], rechoose_every=0.0)
        t0 = time.perf_counter()
        open_run(trainer)
        opened = time.perf_counter() - t0
        steps = [trainer.train_step([batches.next_micro() for _ in range(tr["accumulation"])])
                 for _ in range(tr["steps"])]
        timed = steps[1:]
        return {
            "tokens_per_s": round(sum(s.tokens for s in timed) / sum(s.seconds for s in timed), 1),
            "step_seconds": [round(s.seconds, 3) for s in steps],
            "tokens_per_step": steps[0].tokens,
            "losses": [round(s.loss, 5) for s in steps],
            "open_seconds": round(opened, 2),
            "stages": [[f"{r.start}:{r.end}", [r.peer_id for r in group]] for group in trainer.replicas
                       for r in group[:1]],
            "micro_batches_per_replica": trainer.shares,
        }


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    Path(sys.argv[2]).write_text(json.dumps(run(spec)))


if __name__ == "__main__":
    main()
