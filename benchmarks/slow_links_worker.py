"""One training run of benchmarks/slow_links.py, run as the trainer inside its testbed host.

    python benchmarks/slow_links_worker.py SPEC.json OUT.json

SPEC names the model folder, the swarm (initial peers, this host's address, the trainer's identity), the run
(``run_id``, ``compression``, ``staleness``) and the schedule (steps, micro-batches, seed, optimizer). The run
opens on the stage peers (which resume it from its step-0 checkpoint), trains ``steps`` steps in chain topology
with ``checkpoint_every = steps`` (so every stage saves its final weights), then saves the trainer's own part
(embedding + head) next to them. A setting this checkout's ``SwarmTrainer`` does not take is not run: OUT then
says ``skipped`` and why. Writes one JSON object to OUT.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import open_run  # noqa: E402

from peers.client.swarm_client import SwarmClient  # noqa: E402
from peers.core.config import ClientConfig, SwarmConfig
from peers.trainer.state import save_trainer_state, trainer_checkpoint_path
from peers.trainer.swarm_trainer import StepResult, SwarmTrainer
from peers.training import OptimConfig, TokenBatches, TrainConfig, encode_bytes, read_corpus

DEFAULTS = {"compression": "none", "staleness": 0, "stale_micro_batches": 1}  # a run that sets these needs nothing


def run_options(compression: str, staleness: int | str) -> tuple[dict, str | None]:
    """The ``SwarmTrainer`` keyword arguments for the setting (staleness "1all": every micro-batch of a step stale),
    or why this checkout cannot run it."""
    stale = str(staleness)
    wanted: dict = {"compression": compression, "staleness": int(stale[0])}
    if stale == "1all":
        wanted["stale_micro_batches"] = None
    config = {f.name for f in dataclasses.fields(TrainConfig)}
    takes = inspect.signature(SwarmTrainer).parameters
    options: dict = {}
    for name, value in wanted.items():
        if name in takes:
            options[name] = value
        elif value != DEFAULTS[name]:
            where = "TrainConfig has it but SwarmTrainer takes no such argument" if name in config else \
                "neither TrainConfig nor SwarmTrainer has it yet"
            return {}, f"{name}={value!r} is not available in this checkout ({where})"
    return options, None


def run_steps(trainer: SwarmTrainer, batches: TokenBatches, steps: int, accumulation: int
              ) -> tuple[list[StepResult], list[float]]:
    """``steps`` steps as ``peers.trainer.loop.train_loop`` runs them: with staleness 1 each step also hands over
    the next step's micro-batches (``upcoming``), which start while it drains. Also returns the wall-clock time at
    the end of each step (steps overlap with staleness 1, so their own ``seconds`` do not add up to the run's)."""
    results, ends, upcoming = [], [], None
    train_step: Callable[..., StepResult] = trainer.train_step  # takes ``upcoming`` where staleness exists
    for step in range(1, steps + 1):
        micro = upcoming or [batches.next_micro() for _ in range(accumulation)]
        upcoming = [batches.next_micro() for _ in range(accumulation)] \
            if getattr(trainer, "staleness", 0) and step < steps else None
        results.append(train_step(micro, upcoming) if upcoming is not None else train_step(micro))
        ends.append(time.perf_counter())
    return results, ends


def train(spec: dict) -> dict:
    options, why = run_options(spec["compression"], spec["staleness"])
    if why is not None:
        return {"skipped": why}
    tr = spec["train"]
    swarm = SwarmConfig(initial_peers=tuple(spec["initial_peers"]), host_maddrs=(f"/ip4/{spec['address']}/tcp/0",),
                        identity_path=spec["identity_path"])
    tokens = encode_bytes(read_corpus())
    with SwarmClient(spec["model_dir"], config=ClientConfig(swarm=swarm, request_timeout=300)) as client:
        client.wait_for_records(spec["peers"], timeout=120)
        trainer = SwarmTrainer(client, OptimConfig(**tr["optim"]), tr["accumulation"], in_flight=tr["in_flight"],
                               run_id=spec["run_id"], rechoose_every=0.0, checkpoint_every=tr["steps"],
                               topology="chain", **options)
        open_run(trainer)
        batches = TokenBatches(tokens, tr["seq_len"], tr["micro_batch"], seed=tr["seed"])
        steps, ends = run_steps(trainer, batches, tr["steps"], tr["accumulation"])
        trainer.settle()  # every stage applied every step (the last step of a stale run starts nothing ahead)
        save_trainer_state(trainer, trainer_checkpoint_path(spec["checkpoint_dir"], spec["run_id"]))
        timed = steps[1:]  # the first step opens the run (connections, warm-up): wall clock from its end
        return {
            "options": options,
            "tokens": sum(s.tokens for s in steps),
            "tokens_per_s": round(sum(s.tokens for s in timed) / (ends[-1] - ends[0]), 1),
            "timed_seconds": round(ends[-1] - ends[0], 2),
            "step_seconds": [round(s.seconds, 3) for s in steps],
            "losses": [s.loss for s in steps],
            "stage_busy_s": [[round(b, 3) for b in s.stage_busy] for s in steps],
            "stage_steps": steps[-1].stage_steps,
            "steps_done": trainer.steps_done,
        }


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    Path(sys.argv[2]).write_text(json.dumps(train(spec)))


if __name__ == "__main__":
    main()
