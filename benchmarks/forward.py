"""Forward through 2 real peers vs the same model in one process: latency and throughput, as JSON.

    python benchmarks/forward.py [--repeats 20] [--workdir DIR]

Latency: one forward of batch 1 x 16 tokens. Throughput: batch 8 x 128 tokens. Medians of several runs,
measured side by side in one run (this machine is noisy: read the ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from rich.progress import Progress

from peers.cli.launch import LocalSwarm
from peers.client.swarm_client import SwarmClient
from peers.model import LocalModel, make_tiny_model

MODEL = dict(family="llama", hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=688)


def _median_seconds(fn, repeats: int, progress: Progress, label: str) -> float:
    task = progress.add_task(label, total=repeats + 2)
    for _ in range(2):  # warm-up: connections, allocator
        fn()
        progress.advance(task)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        progress.advance(task)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)  # like each peer process (LocalSwarm starts them with --num_threads 1)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fusionswarm-bench-"))
    model_dir = make_tiny_model(workdir / "llama-bench", seed=0, **MODEL)
    local = LocalModel.from_dir(model_dir)
    small = torch.randint(0, 256, (1, 16))
    large = torch.randint(0, 256, (8, 128))

    with LocalSwarm(workdir, update_period=5.0) as swarm, Progress(transient=True) as progress:
        swarm.start_dht()
        procs = [swarm.start_peer(model_dir, block_indices=s, wait=False) for s in ("0:4", "4:8")]
        for proc in procs:
            swarm.wait_ready(proc)
        with SwarmClient(model_dir, initial_peers=swarm.initial_peers) as client:
            max_diff = (client.forward(large) - local(large)[0]).abs().max().item()
            local_lat = _median_seconds(lambda: local(small), args.repeats, progress, "local 1x16")
            swarm_lat = _median_seconds(lambda: client.forward(small), args.repeats, progress, "swarm 1x16")
            big_repeats = max(3, args.repeats // 4)
            local_big = _median_seconds(lambda: local(large), big_repeats, progress, "local 8x128")
            swarm_big = _median_seconds(lambda: client.forward(large), big_repeats, progress, "swarm 8x128")

    tokens = large.numel()
    print(json.dumps({
        "benchmark": "forward",
        "model": {**MODEL, "dtype": "float32"},
        "peers": 2,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, 1 torch thread per process",
        "latency_1x16_ms": {"local": round(1e3 * local_lat, 2), "swarm_2_peers": round(1e3 * swarm_lat, 2),
                            "swarm_minus_local": round(1e3 * (swarm_lat - local_lat), 2)},
        "throughput_8x128_tokens_per_s": {
            "local": round(tokens / local_big), "swarm_2_peers": round(tokens / swarm_big),
                                          "swarm_over_local": round(local_big / swarm_big, 3)},
        "max_abs_logit_diff": max_diff,
        "repeats": args.repeats,
    }, indent=2))


if __name__ == "__main__":
    main()
