"""A/B check of per-token generation latency: run it on two checkouts alternately and compare the medians.

    python benchmarks/ab_step_latency.py --label new
    (cd OTHER_CHECKOUT && PYTHONPATH=. python /path/to/benchmarks/ab_step_latency.py --label old)

2 peers (blocks 0:4, 4:8) of the demo-size tiny Llama on 127.0.0.1; 6 runs of 48 greedy tokens, the first
run is a warm-up; prints JSON with the median and mean gap between consecutive tokens.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from peers.cli.launch import LocalSwarm
from peers.client.swarm_client import SwarmClient
from peers.model import make_tiny_model


def main(label: str, runs: int = 6, tokens: int = 48) -> dict:
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="fusionswarm-ab-"))
    try:
        model = make_tiny_model(work / "model", family="llama", hidden_size=256, num_layers=8, num_heads=8,
                                num_kv_heads=4, intermediate_size=688, seed=0)
        with LocalSwarm(work, update_period=10.0) as swarm:
            swarm.start_dht()
            peers = [swarm.start_peer(model, block_indices=span, wait=False) for span in ("0:4", "4:8")]
            for peer in peers:
                swarm.wait_ready(peer)
            with SwarmClient(model, initial_peers=swarm.initial_peers) as client:
                client.wait_for_records(2)
                gaps = _gaps(client, runs, tokens)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"benchmark": "ab_step_latency", "label": label, "tokens": len(gaps),
            "median_ms": round(1e3 * statistics.median(gaps), 2), "mean_ms": round(1e3 * statistics.mean(gaps), 2)}


def _gaps(client: SwarmClient, runs: int, tokens: int) -> list[float]:
    prompt, gaps = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]), []
    for run in range(runs):
        last = time.perf_counter()
        for index, _ in enumerate(client.iter_generate(prompt, tokens)):
            now = time.perf_counter()
            if index > 0 and run > 0:  # the first token includes the prompt; the first run warms up
                gaps.append(now - last)
            last = now
    return gaps


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default="this checkout")
    print(json.dumps(main(parser.parse_args().label), indent=2))
