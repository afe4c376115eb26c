"""Prompt tuning through 3 real stage peers vs the same in one process: steps/s and their ratio, as JSON.

    python benchmarks/prompt_tuning.py [--steps 20] [--variants deep,input] [--quick] [--out results/prompt_tuning.json]

The workload of Petals' prompt-tuning step: a batch of 4 sequences of 64 tokens (65-token windows: 64 predicted) with
16 prompt vectors in front; ``deep``: also 16 per block (deep prompt tuning), ``input``: input prompts only. One
micro-batch per optimizer step (AdamW on the prompts only; the model is frozen). Every variant trains the same prompts
from the same seed on the same micro-batches:

* one process: ``LocalTrainer(prompts=16)`` with the same 3-stage split, with torch's default thread count and with 1
  thread; each run first and again last, its steps/s is the mean of the two (a guard against drift on a shared
  machine). On a busy machine a many-threaded torch process slows down many-fold when another process takes a core,
  so the 1-thread run is the steadier reference there;
* the swarm: ``SwarmTrainer(prompts=16, topology="star")`` (prompt tuning runs in the star topology), the trainer in
  this process (1 torch thread) and 3 peer processes on 127.0.0.1 (1 torch thread each), encrypted streams.

steps/s leaves out the first step (connections, warm-up). The swarm's losses are compared with one process's (bit for
bit, fp32). ``--quick``: a tiny model and 3 steps, only to check that the script works; nothing is written.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import report  # noqa: E402
from train import MODEL, QUICK_MODEL, SEED, client_config, open_run, stage_spans, start_stage_peers  # noqa: E402

from peers.cli.launch import LocalSwarm  # noqa: E402
from peers.client.swarm_client import SwarmClient  # noqa: E402
from peers.model import make_tiny_model  # noqa: E402
from peers.trainer.swarm_trainer import SwarmTrainer  # noqa: E402
from peers.training import LocalTrainer, OptimConfig, TokenBatches, encode_bytes, read_corpus  # noqa: E402

BATCH, TOKENS, PROMPTS = 4, 64, 16  # Petals' prompt-tuning step
VARIANTS = ("deep", "input")


def optim_config(steps: int) -> OptimConfig:
    return OptimConfig(lr=1e-2, warmup_steps=2, schedule="cosine", total_steps=steps, clip_norm=1.0, weight_decay=0.0)


def rate(seconds: list[float]) -> float:
    """Steps per second over the steps after the first."""
    return round((len(seconds) - 1) / sum(seconds[1:]), 3)


def local_run(model_dir: Path, tokens: torch.Tensor, spans, steps: int, deep: bool) -> dict:
    trainer = LocalTrainer(model_dir, optim_config(steps), 1, stages=spans, prompts=PROMPTS, deep_prompts=deep,
                           seed=SEED)
    batches = TokenBatches(tokens, TOKENS, BATCH, seed=SEED)
    losses, seconds = [], []
    for _ in range(steps):
        micro = batches.next_micro()
        started = time.perf_counter()
        losses.append(trainer.train_step([micro]))
        seconds.append(time.perf_counter() - started)
    return {"steps_per_s": rate(seconds), "step_losses": losses, "step_seconds": [round(s, 4) for s in seconds],
            "torch_threads": torch.get_num_threads()}


def swarm_run(swarm: LocalSwarm, model_dir: Path, tokens: torch.Tensor, steps: int, deep: bool, run_id: str) -> dict:
    with SwarmClient(model_dir, config=client_config(swarm)) as client:
        client.wait_for_records(3)
        trainer = SwarmTrainer(client, optim_config(steps), 1, in_flight=1, run_id=run_id, topology="star",
                               prompts=PROMPTS, deep_prompts=deep, prompt_seed=SEED)
        open_run(trainer)
        batches = TokenBatches(tokens, TOKENS, BATCH, seed=SEED)
        results = [trainer.train_step([batches.next_micro()]) for _ in range(steps)]
        seconds = [r.seconds for r in results]
        busy = [statistics.fmean(b) for b in zip(*(r.stage_busy for r in results[1:]), strict=True)]
        return {"steps_per_s": rate(seconds), "step_losses": [r.loss for r in results],
                "step_seconds": [round(s, 4) for s in seconds],
                "stage_compute_s_per_step": [round(b, 4) for b in busy],
                "trainer_sent_KB_per_step": round(trainer.bytes_sent / steps / 1024, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, 3 steps: check that it works")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run (the first is not timed)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated: deep, input")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "prompt_tuning.json")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    if not variants or any(v not in VARIANTS for v in variants):
        parser.error(f"--variants: choose from {', '.join(VARIANTS)}")
    model, steps = (QUICK_MODEL, 3) if args.quick else (MODEL, args.steps)
    if steps < 2:
        parser.error("--steps must be at least 2 (the first step is not timed)")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fusionswarm-prompts-"))
    model_dir = make_tiny_model(workdir / "llama-prompts", seed=SEED, **model)
    spans = stage_spans(model["num_layers"], 3)
    tokens = encode_bytes(read_corpus())
    default_threads = torch.get_num_threads()
    def local_runs() -> dict[str, dict]:
        runs = {v: local_run(model_dir, tokens, spans, steps, v == "deep") for v in variants}
        torch.set_num_threads(1)
        runs.update({f"{v}/1": local_run(model_dir, tokens, spans, steps, v == "deep") for v in variants})
        torch.set_num_threads(default_threads)
        return runs

    first = local_runs()
    swarm_runs = {}
    with LocalSwarm(workdir, update_period=10.0, train=True) as swarm:
        start_stage_peers(swarm, model_dir, spans, workdir / "checkpoints")
        torch.set_num_threads(1)  # the trainer's process, like each peer
        for i, v in enumerate(variants):
            swarm_runs[v] = swarm_run(swarm, model_dir, tokens, steps, v == "deep", f"prompts-bench-{i}")
        torch.set_num_threads(default_threads)
    last = local_runs()
    out = {}
    for v in variants:
        local_rate = statistics.fmean([first[v]["steps_per_s"], last[v]["steps_per_s"]])
        single_rate = statistics.fmean([first[f"{v}/1"]["steps_per_s"], last[f"{v}/1"]["steps_per_s"]])
        out[v] = {
            "one_process_steps_per_s": round(local_rate, 3),
            "one_process_steps_per_s_first_last": [first[v]["steps_per_s"], last[v]["steps_per_s"]],
            "one_process_1_thread_steps_per_s": round(single_rate, 3),
            "one_process_1_thread_steps_per_s_first_last": [first[f"{v}/1"]["steps_per_s"],
                                                            last[f"{v}/1"]["steps_per_s"]],
            "swarm_steps_per_s": swarm_runs[v]["steps_per_s"],
            "swarm_over_one_process": round(swarm_runs[v]["steps_per_s"] / local_rate, 3),
            "swarm_over_one_process_1_thread": round(swarm_runs[v]["steps_per_s"] / single_rate, 3),
            "losses_equal_one_process_bit_for_bit": swarm_runs[v]["step_losses"] == first[v]["step_losses"],
            "loss_first_last": [first[v]["step_losses"][0], first[v]["step_losses"][-1]],
            "swarm": swarm_runs[v],
            "one_process_step_seconds_first_run": first[v]["step_seconds"],
        }
    result = {
        "benchmark": "prompt_tuning",
        "quick": args.quick,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end",
        "model": {**model, "dtype": "float32"},
        "stages": spans,
        "workload": {"batch": BATCH, "tokens": TOKENS, "prompts": PROMPTS, "micro_batches_per_step": 1,
                     "steps": steps, "timed_steps": steps - 1, "topology": "star", "seed": SEED},
        "optim": optim_config(steps).to_dict(),
        "torch_threads": {"one_process": default_threads, "swarm_trainer_process": 1, "each_peer": 1},
        "variants": out,
    }
    warnings = [f"{v}: the two one-process runs differ ({first[v]['steps_per_s']} vs {last[v]['steps_per_s']} "
                "steps/s): the machine was busy; rerun on a quiet machine" for v in first
                if abs(first[v]["steps_per_s"] - last[v]["steps_per_s"]) > 0.2 * max(first[v]["steps_per_s"],
                                                                                   last[v]["steps_per_s"])]
    if warnings:
        result["warning"] = warnings
    report(result, args.out, write=not args.quick)


if __name__ == "__main__":
    main()
