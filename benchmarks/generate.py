"""Generation through 2 real peers vs locally: per-token latency, concurrency, and a peer killed mid-way.

    python benchmarks/generate.py [--runs 5] [--workdir DIR]

Tiny Llama (hidden 256, 8 blocks, fp32), 8-token prompt, 32 new tokens, greedy. Every figure is measured in
this one run, side by side with its baseline; the JSON goes to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import tempfile
import time
from pathlib import Path

import torch
from rich.progress import Progress

from peers.cli.launch import LocalSwarm
from peers.client.generation import generate_stream
from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig, SwarmConfig
from peers.model import LocalModel, make_tiny_model

MODEL = dict(family="llama", hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=688)
PROMPT, NEW = 8, 32


def _intervals(times: list[float]) -> list[float]:
    """Per-token latency: the gaps between consecutive tokens (the first token also pays for the prompt)."""
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def local_token_times(model: LocalModel, input_ids: torch.Tensor) -> list[float]:
    times = []
    with torch.inference_mode():
        logits, past = model(input_ids)
        token = logits[:, -1].argmax(-1, keepdim=True)
        times.append(time.perf_counter())
        for _ in range(NEW - 1):
            logits, past = model(token, past=past)
            token = logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter())
    return times


def swarm_token_times(client: SwarmClient, input_ids: torch.Tensor) -> tuple[list[float], list[int]]:
    times, tokens = [], []
    for token in client.iter_generate(input_ids, NEW):
        times.append(time.perf_counter())
        tokens.append(int(token[0]))
    return times, tokens


def concurrent_tokens_per_s(client: SwarmClient, sessions: int) -> float:
    prompts = [torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(i)) for i in range(sessions)]

    async def run() -> float:
        async def one(ids):
            return len([t async for t in generate_stream(client, ids, NEW)])

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(ids) for ids in prompts))
        return sum(counts) / (time.perf_counter() - t0)

    return client.loop.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the peers use one thread each too: all share this machine's cores
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fusionswarm-bench-"))
    model_dir = make_tiny_model(workdir / "llama-bench", seed=0, **MODEL)
    local = LocalModel.from_dir(model_dir)
    input_ids = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    expected = local.generate_greedy(input_ids, NEW)[0, PROMPT:].tolist()
    result: dict = {"benchmark": "generate", "model": {**MODEL, "dtype": "float32"}, "prompt": PROMPT,
                    "new_tokens": NEW, "runs": args.runs, "torch_threads_per_process": 1}

    with LocalSwarm(workdir, update_period=2.0) as swarm, Progress(transient=True) as progress:
        swarm.start_dht()
        procs = [swarm.start_peer(model_dir, block_indices=s, wait=False) for s in ("0:4", "4:8")]
        for proc in procs:
            swarm.wait_ready(proc)
        config = ClientConfig(swarm=SwarmConfig(initial_peers=tuple(swarm.initial_peers)), request_timeout=10)
        with SwarmClient(model_dir, config=config) as client:
            task = progress.add_task("per-token latency", total=2 * (args.runs + 1))
            local_gaps, swarm_gaps, same = [], [], True
            for run in range(args.runs + 1):  # run 0 warms up connections and caches
                gaps = _intervals(local_token_times(local, input_ids))
                progress.advance(task)
                times, tokens = swarm_token_times(client, input_ids)
                progress.advance(task)
                same &= tokens == expected
                if run:
                    local_gaps += gaps
                    swarm_gaps += _intervals(times)
            local_ms, swarm_ms = 1e3 * statistics.median(local_gaps), 1e3 * statistics.median(swarm_gaps)
            result["per_token_latency_ms"] = {"local": round(local_ms, 2), "swarm_2_peers": round(swarm_ms, 2),
                                              "swarm_minus_local": round(swarm_ms - local_ms, 2)}
            result["greedy_tokens_equal_local"] = same

            task = progress.add_task("concurrent sessions", total=3)
            rates = {}
            for n in (1, 4, 16):
                rates[n] = concurrent_tokens_per_s(client, n)
                progress.advance(task)
            result["aggregate_tokens_per_s"] = {f"{n}_sessions": round(r, 1) for n, r in rates.items()}
            result["aggregate_16_over_1"] = round(rates[16] / rates[1], 2)

            task = progress.add_task("peer killed mid-generation", total=2)
            replica = swarm.start_peer(model_dir, block_indices="4:8")
            client.router.refresh_period = 0.0
            t0 = time.perf_counter()
            base_times, _ = swarm_token_times(client, input_ids)
            baseline_s = base_times[-1] - t0
            progress.advance(task)
            t0, tokens, killed = time.perf_counter(), [], False
            for token in client.iter_generate(input_ids, NEW):
                tokens.append(int(token[0]))
                if len(tokens) == NEW // 2 and not killed:
                    busy = [p for p in (procs[1], replica) if client.info(p.peer_id).sessions > 0]
                    busy[0].kill(signal.SIGKILL)
                    killed = True
            with_kill_s = time.perf_counter() - t0
            progress.advance(task)
            result["peer_killed_at_token_16"] = {
                "generation_s_without_failure": round(baseline_s, 3),
                "generation_s_with_failure": round(with_kill_s, 3),
                "time_lost_s": round(with_kill_s - baseline_s, 3),
                "tokens_equal_local": tokens == expected,
            }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
