"""Where swarm training's CPU goes: CPU seconds of every process (trainer, stage peers, their p2p daemons) for
one swarm run, next to the one-process run on the same micro-batches, as JSON. Linux only (reads /proc).

    python benchmarks/train_cpu.py [--in_flight 4] [--steps 8] [--out results/train_cpu.json]

Same model, data and stage split as ``benchmarks/train.py``. The one-process trainer runs twice, with torch's
default thread count and with 1 thread; the swarm's stage peers and trainer use 1 thread each. CPU seconds
count the timed steps only (all but the first), so the figures divide by the same tokens. The stage peers also
report the wall time they spent computing (``stage_busy_s``); a stage's CPU seconds beyond its own compute is
its share of serialization, encryption and the stream machinery.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from train import (
    FULL,
    MODEL,
    SEED,
    client_config,
    local_training,
    open_run,
    optim_config,
    stage_spans,
    start_stage_peers,
    write_initial_state,
)

from peers.cli.launch import LocalSwarm
from peers.client.swarm_client import SwarmClient
from peers.model import make_tiny_model
from peers.trainer.swarm_trainer import SwarmTrainer
from peers.training import TokenBatches, encode_bytes, read_corpus

TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()  # fields from the 3rd on: state, ppid, pgrp, session, ...


def process_table() -> dict[int, tuple[str, int, int]]:
    """pid -> (command name, parent pid, session id) of every process."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/comm") as f:
                    name = f.read().strip()
                fields = _stat(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                continue
            table[int(entry)] = (name, int(fields[1]), int(fields[3]))
    return table


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes have used so far (0 for one that is gone)."""
    total = 0.0
    for pid in pids:
        try:
            fields = _stat(pid)
        except (FileNotFoundError, ProcessLookupError):
            continue
        total += (int(fields[11]) + int(fields[12])) / TICK
    return total


def groups_of(swarm: LocalSwarm) -> dict[str, list[int]]:
    """The trainer, its p2p daemon, and each stage peer and its daemon (a peer's session holds its daemon)."""
    table, me = process_table(), os.getpid()
    groups = {"trainer": [me], "trainer p2pd": [p for p, (n, ppid, _) in table.items() if ppid == me and n == "p2pd"]}
    for proc in swarm.processes:
        if proc.name.startswith("stage"):
            members = [(p, n) for p, (n, _, session) in table.items() if session == proc.pid]
            groups[proc.name] = [p for p, n in members if n != "p2pd"]
            groups[f"{proc.name} p2pd"] = [p for p, n in members if n == "p2pd"]
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in_flight", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps (the first is not counted)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "train_cpu.json")
    args = parser.parse_args()
    setup = replace(FULL, steps=args.steps)
    workdir = Path(tempfile.mkdtemp(prefix="fusionswarm-cpu-"))
    model_dir = make_tiny_model(workdir / "llama-train", seed=SEED, **MODEL)
    spans = stage_spans(MODEL["num_layers"], 3)
    tokens = encode_bytes(read_corpus())
    timed_tokens = (setup.steps - 1) * setup.seq_len * setup.micro_batch * setup.accumulation
    result: dict = {"benchmark": "train_cpu", "model": MODEL, "in_flight": args.in_flight,
                    "timed_steps": setup.steps - 1, "timed_tokens": timed_tokens, "one_process": {}}
    with LocalSwarm(workdir, update_period=10.0, train=True) as swarm:
        start_stage_peers(swarm, model_dir, spans, workdir / "checkpoints")
        for threads in (torch.get_num_threads(), 1):
            torch.set_num_threads(threads)
            before = time.process_time()
            run = local_training(model_dir, tokens, setup, spans, lambda: None)
            cpu = (time.process_time() - before) * (setup.steps - 1) / setup.steps  # steps are alike: drop one
            result["one_process"][f"{threads} thread(s)"] = {
                "tokens_per_s": run["tokens_per_s"], "cpu_s": round(cpu, 2),
                "cpu_ms_per_token": round(1e3 * cpu / timed_tokens, 4)}
        write_initial_state(model_dir, workdir / "checkpoints", "cpu", spans, optim_config(setup.steps))
        with SwarmClient(model_dir, config=client_config(swarm)) as client:
            client.wait_for_records(len(spans))
            groups = groups_of(swarm)
            trainer = SwarmTrainer(client, optim_config(setup.steps), setup.accumulation, in_flight=args.in_flight,
                                   run_id="cpu")
            open_run(trainer)
            batches = TokenBatches(tokens, setup.seq_len, setup.micro_batch, seed=SEED)
            trainer.train_step([batches.next_micro() for _ in range(setup.accumulation)])  # connections, warm-up
            before = {name: cpu_seconds(pids) for name, pids in groups.items()}
            started = time.perf_counter()
            steps = [trainer.train_step([batches.next_micro() for _ in range(setup.accumulation)])
                     for _ in range(setup.steps - 1)]
            wall = time.perf_counter() - started
            used = {name: round(cpu_seconds(pids) - before[name], 2) for name, pids in groups.items()}
        total = sum(used.values())
        result["swarm"] = {
            "tokens_per_s": round(timed_tokens / wall, 1), "wall_s": round(wall, 2), "cpu_s": used,
            "cpu_s_total": round(total, 2), "cpu_ms_per_token": round(1e3 * total / timed_tokens, 4),
            "cores_busy": round(total / wall, 2), "cores": os.cpu_count(),
            "stage_busy_s": [round(sum(s.stage_busy[i] for s in steps), 2) for i in range(len(spans))],
        }
    one_thread = result["one_process"]["1 thread(s)"]["cpu_ms_per_token"]
    result["swarm_cpu_over_one_thread_process"] = round(result["swarm"]["cpu_ms_per_token"] / one_thread, 3)
    text = json.dumps(result, indent=2)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
