"""``swarm api`` vs the Python client: time to first token and tokens/s, 1 and 16 concurrent requests, one run.

    python benchmarks/api.py [--concurrency 1,16] [--runs 3] [--new 32] [--quick] [--out FILE] [--workdir DIR]

One local swarm of real peers on 127.0.0.1 (tiny Llama, hidden 256, 8 blocks, fp32, blocks 0:4 and 4:8 on two
peers, encrypted streams, chain topology). On the same swarm, interleaved, ``--runs`` times after a warm-up:

* ``client``: the Python client in this process (``SwarmClient`` + ``generate_stream``), N concurrent sessions from
  one client, tokens counted as they come;
* ``api``: ``swarm api`` as its own process (one ``SwarmClient`` for all requests), N concurrent streaming
  ``/v1/completions`` requests from the official ``openai`` client (``AsyncOpenAI``), tokens from each reply's
  usage (``stream_options.include_usage``).

Same prompts (8-character texts, 8 byte tokens) and ``--new`` greedy tokens per request (temperature 0; the tiny
model's random weights may end a reply early with its end token: the tokens counted are the ones generated).
Figures: time to first token (request sent -> first token here / first text chunk received), its median and max
over the requests, and the aggregate tokens/s (all requests' tokens / wall time from the first request to the last
reply); the median over the runs. JSON on stdout and in ``--out`` (default ``benchmarks/results/api.json``);
``--quick``: 1 run, not saved.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai
import torch

from peers.cli.launch import LocalSwarm
from peers.client.generation import generate_stream
from peers.client.swarm_client import SwarmClient
from peers.client.textgen import load_tokenizer
from peers.core.config import ClientConfig, SwarmConfig
from peers.model import make_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import report  # noqa: E402

MODEL = dict(family="llama", hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=688)
SPANS = ("0:4", "4:8")
RESULTS = Path(__file__).resolve().parent / "results" / "api.json"


def prompts(count: int) -> list[str]:
    return [f"Req {i:03d}:" for i in range(count)]  # 8 bytes: 8 tokens of the byte tokenizer


async def client_run(client: SwarmClient, ids: list[list[int]], new: int) -> dict:
    async def one(prompt: list[int]) -> tuple[float, int]:
        sent, first, count = time.perf_counter(), None, 0
        async for _ in generate_stream(client, torch.tensor([prompt]), new):
            first = first or time.perf_counter() - sent
            count += 1
        return first or 0.0, count

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in ids))
    return figures(results, time.perf_counter() - t0)


async def api_run(url: str, texts: list[str], new: int) -> dict:
    async with openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=300) as api:
        async def one(prompt: str) -> tuple[float, int]:
            sent, first, count = time.perf_counter(), None, 0
            stream = await api.completions.create(model="llama", prompt=prompt, max_tokens=new, temperature=0,
                                                  stream=True, stream_options={"include_usage": True})
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text and first is None:
                    first = time.perf_counter() - sent
                if chunk.usage is not None:
                    count = chunk.usage.completion_tokens
            return first or 0.0, count

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in texts))
        return figures(results, time.perf_counter() - t0)


def figures(results: list[tuple[float, int]], wall: float) -> dict:
    firsts = [f for f, _ in results]
    tokens = sum(n for _, n in results)
    return {"ttft_ms_median": 1000 * statistics.median(firsts), "ttft_ms_max": 1000 * max(firsts),
            "tokens": tokens, "tokens_per_s": tokens / wall}


def start_api(model_dir: Path, swarm: LocalSwarm, log: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "peers.cli", "api", str(model_dir), "--initial_peers",
                             *swarm.initial_peers, "--port", "0"], stdout=subprocess.PIPE, stderr=log.open("w"),
                            text=True, start_new_session=True)
    line = proc.stdout.readline()
    match = re.search(r"(http://\S+/v1)", line)
    if not match:
        proc.kill()
        raise RuntimeError(f"swarm api did not start:\n{log.read_text()[-3000:]}")
    return proc, match.group(1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="1 run, not saved")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    runs = 1 if args.quick else args.runs
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="api_bench_"))
    model_dir = make_tiny_model(workdir / "llama", seed=0, **MODEL)
    tokenizer = load_tokenizer(model_dir)
    samples: dict[str, dict[int, list[dict]]] = {"client": {n: [] for n in levels}, "api": {n: [] for n in levels}}
    with LocalSwarm(workdir / "swarm", update_period=2.0) as swarm:
        swarm.start_dht()
        for proc in [swarm.start_peer(model_dir, block_indices=span, wait=False) for span in SPANS]:
            swarm.wait_ready(proc)
        config = ClientConfig(swarm=SwarmConfig(initial_peers=tuple(swarm.initial_peers)))
        api, url = start_api(model_dir, swarm, workdir / "api.log")
        try:
            with SwarmClient(model_dir, config=config) as client:
                client.wait_for_records(len(SPANS))
                for run in range(runs + 1):  # run 0: warm-up (streams, handshakes), not counted
                    for n in levels:
                        texts = prompts(n)
                        ids = [tokenizer.encode(t).ids for t in texts]
                        direct = client.loop.run(client_run(client, ids, args.new))
                        through = asyncio.run(api_run(url, texts, args.new))
                        if run:
                            samples["client"][n].append(direct)
                            samples["api"][n].append(through)
                        print(f"run {run} x{n}: client {direct['tokens_per_s']:.0f} tok/s, api "
                              f"{through['tokens_per_s']:.0f} tok/s", file=sys.stderr, flush=True)
        finally:
            os.killpg(api.pid, signal.SIGTERM)
            api.wait(30)
    result: dict = {"model": MODEL, "spans": list(SPANS), "new_tokens": args.new, "prompt_tokens": 8, "runs": runs,
                    "machine": platform.platform(), "cpus": os.cpu_count(), "load_average": os.getloadavg(),
                    "results": {}}
    for n in levels:
        row = {}
        for mode in ("client", "api"):
            row[mode] = {key: round(statistics.median(s[key] for s in samples[mode][n]), 1)
                         for key in ("ttft_ms_median", "ttft_ms_max", "tokens", "tokens_per_s")}
        row["api_over_client_tokens_per_s"] = round(row["api"]["tokens_per_s"] / row["client"]["tokens_per_s"], 3)
        row["api_minus_client_ttft_ms"] = round(row["api"]["ttft_ms_median"] - row["client"]["ttft_ms_median"], 1)
        result["results"][f"concurrency_{n}"] = row
    report(result, args.out, write=not args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
