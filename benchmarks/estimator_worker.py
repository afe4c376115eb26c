"""The measured side of benchmarks/estimator.py: a client and a trainer in one process (in a testbed host).

    python benchmarks/estimator_worker.py --model DIR --initial_peers ... --allowed ID,ID --identity FILE --out FILE

It uses only the allowed peers (the case's pipeline), generates ``--new`` tokens greedily after an ``--context``
token prompt, ``--runs`` times (per-token latency: the median gap between tokens, leaving out the first two), then
trains with each ``--in_flight`` value for ``--steps`` steps (tokens/s: the median step, leaving out the first: it
opens the run). Also the best figures (the best run's median gap, the fastest step): the machine is shared, and
they are what it does when it has the cores.
Writes one JSON object to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig, SwarmConfig
from peers.trainer.swarm_trainer import SwarmTrainer
from peers.training import OptimConfig

OPTIM = OptimConfig(lr=1e-4, clip_norm=1.0, weight_decay=0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--initial_peers", nargs="+", required=True)
    parser.add_argument("--allowed", required=True, help="comma-separated peer ids of the pipeline's stages")
    parser.add_argument("--identity", type=Path, required=True, help="the trainer's identity file")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--context", type=int, default=8)
    parser.add_argument("--new", type=int, default=24)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--seq_len", type=int, default=32)
    parser.add_argument("--micro_batches", type=int, default=4)
    parser.add_argument("--in_flight", default="1,4")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    allowed = tuple(args.allowed.split(","))
    config = ClientConfig(swarm=SwarmConfig(initial_peers=tuple(args.initial_peers), identity_path=args.identity),
                          allowed_peers=allowed, request_timeout=120)
    result: dict = {}
    with SwarmClient(args.model, config=config) as client:
        client.wait_for_records(len(allowed), timeout=120)
        gaps, rounds = [], []
        for run in range(args.runs):
            ids = torch.randint(0, 200, (1, args.context), generator=torch.Generator().manual_seed(run))
            stamps = [time.perf_counter() for _ in client.iter_generate(ids, args.new)]
            gaps += [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]
            rounds.append(statistics.median(gaps[-(len(stamps) - 2):]))
        result["token_latency_s"] = statistics.median(gaps)
        result["token_latency_best_s"] = min(rounds)  # the best run's median (the machine is shared)
        result["token_gaps_s"] = [round(g, 5) for g in gaps]
        result["training"] = {}
        for k in (int(v) for v in args.in_flight.split(",")):
            trainer = SwarmTrainer(client, OPTIM, args.micro_batches, in_flight=k, run_id=f"estimator-k{k}",
                                   rechoose_every=0.0)
            generator = torch.Generator().manual_seed(k)
            steps = []
            for _ in range(args.steps):
                micro = [torch.randint(0, 200, (args.rows, args.seq_len + 1), generator=generator)
                         for _ in range(args.micro_batches)]
                steps.append(trainer.train_step(micro))
            seconds = [s.seconds for s in steps[1:]]
            result["training"][str(k)] = {
                "tokens_per_s": steps[1].tokens / statistics.median(seconds),
                "tokens_per_s_best": steps[1].tokens / min(seconds),  # the fastest step (the machine is shared)
                "step_s": [round(s, 4) for s in seconds],
                "stage_busy_s": [[round(b, 4) for b in s.stage_busy] for s in steps[1:]],
                "stages": [f"{r.start}:{r.end}" for r in trainer.stages],
            }
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
