"""Generation through real peers, star and chain, vs one process: per-token latency, link bytes, concurrency, a kill.

    python benchmarks/generate.py [--topologies star,chain] [--peers 2,4] [--runs 5] [--quick] [--out FILE]
                                  [--workdir DIR]

Tiny Llama (hidden 256, 8 blocks, fp32), 8-token prompt, 32 new tokens, greedy. For each peer count (2 peers:
blocks 0:4, 4:8; 4 peers: 0:2, 2:4, 4:6, 6:8) one swarm on 127.0.0.1 and one client per topology (``star``: every
hidden state goes client -> stage -> client -> next stage; ``chain``: each stage pushes its output to the next,
the client sends the first hop's input and gets the last hop's output). In the same run and interleaved (one
process, then each topology, ``--runs`` times after a warm-up):

* per-token latency: the median gap between consecutive tokens, and its ratio to one process; also the best run's
  (the lowest of the runs' median gaps, each side: what this shared machine does when it has the cores);
* greedy tokens equal to one process's;
* bytes crossing the client's link: every frame of its streams both ways (``PeerStream.bytes_sent`` +
  ``bytes_received``) over one generation divided by the new tokens (prompt, open and close included), and per
  decode step (the difference between a 32- and a 16-token generation, divided by 16: no prompt, open or close),
  each also in hidden states (256 x 4 bytes) and split into tensor payload and the rest (metadata, framing, tags).

With 2 peers, for each topology: N concurrent sessions from one client (aggregate tokens/s), and a third peer
replicating blocks 4:8, of which the one holding the session is SIGKILLed at token 16 (time lost, tokens equal).
``--quick``: 2 runs, 1 and 4 sessions (a check that it works, < 2 min). JSON on stdout (and to ``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.progress import Progress

from peers.cli.launch import LocalSwarm, SwarmProcess
from peers.client.generation import generate_stream
from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig, SwarmConfig
from peers.model import LocalModel, make_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from linkbytes import LinkMeter, Reading  # noqa: E402

MODEL = dict(family="llama", hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=688)
PROMPT, NEW = 8, 32
SPANS = {2: ("0:4", "4:8"), 4: ("0:2", "2:4", "4:6", "6:8")}
TOPOLOGIES = ("star", "chain")
SETTLE_S = 0.1  # after a generation whose bytes are read: its close message is sent without a reply


def has_topology() -> bool:
    """Whether this checkout's ``ClientConfig`` has ``topology`` (before the chain landed, only the star exists)."""
    return any(f.name == "topology" for f in dataclasses.fields(ClientConfig))


def client_config(swarm: LocalSwarm, topology: str) -> ClientConfig:
    extra = {"topology": topology} if has_topology() else {}
    return ClientConfig(swarm=SwarmConfig(initial_peers=tuple(swarm.initial_peers)), request_timeout=10, **extra)


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


def swarm_token_times(client: SwarmClient, input_ids: torch.Tensor, new: int = NEW) -> tuple[list[float], list[int]]:
    times, tokens = [], []
    for token in client.iter_generate(input_ids, new):
        times.append(time.perf_counter())
        tokens.append(int(token[0]))
    return times, tokens


def link_bytes(client: SwarmClient, meter: LinkMeter, input_ids: torch.Tensor) -> dict:
    """What one generation moves over the client's link, per new token and per decode step."""
    def generation(new: int) -> Reading:
        before = meter.reading(client)
        swarm_token_times(client, input_ids, new)
        time.sleep(SETTLE_S)
        return meter.reading(client) - before

    full, half = generation(NEW), generation(NEW // 2)
    hidden = MODEL["hidden_size"]
    return {"per_new_token": full.per(NEW, hidden), "per_decode_step": (full - half).per(NEW - NEW // 2, hidden),
            "generation_bytes": full.frame_bytes}


def concurrent_tokens_per_s(client: SwarmClient, sessions: int) -> float:
    prompts = [torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(i)) for i in range(sessions)]

    async def run() -> float:
        async def one(ids):
            return len([t async for t in generate_stream(client, ids, NEW)])

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(ids) for ids in prompts))
        return sum(counts) / (time.perf_counter() - t0)

    return client.loop.run(run())


def peer_killed(client: SwarmClient, replicas: list[SwarmProcess], input_ids: torch.Tensor,
                expected: list[int]) -> dict:
    """Generate once (warm-up: re-routes around any peer killed earlier), once timed, then once more killing the
    replica of blocks 4:8 that holds the session at token 16; ``replicas`` loses the killed one."""
    client.router.refresh_period = 0.0  # see the new replica at once
    swarm_token_times(client, input_ids)
    t0 = time.perf_counter()
    base_times, _ = swarm_token_times(client, input_ids)
    baseline_s = base_times[-1] - t0
    t0, tokens, killed = time.perf_counter(), [], None
    for token in client.iter_generate(input_ids, NEW):
        tokens.append(int(token[0]))
        if len(tokens) == NEW // 2 and killed is None:
            busy = [p for p in replicas if client.info(p.peer_id).sessions > 0]
            killed = busy[0] if busy else None
            if killed is not None:
                killed.kill(signal.SIGKILL)
                replicas.remove(killed)
    with_kill_s = time.perf_counter() - t0
    return {
        "generation_s_without_failure": round(baseline_s, 3),
        "generation_s_with_failure": round(with_kill_s, 3),
        "time_lost_s": round(with_kill_s - baseline_s, 3),
        "killed_a_peer_holding_the_session": killed is not None,
        "tokens_equal_local": tokens == expected,
    }


def measure_peers(swarm: LocalSwarm, model_dir: Path, local: LocalModel, peers: int, topologies: list[str],
                  args: argparse.Namespace, progress: Progress, meter: LinkMeter) -> dict:
    input_ids = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    expected = local.generate_greedy(input_ids, NEW)[0, PROMPT:].tolist()
    swarm.start_dht()
    procs = [swarm.start_peer(model_dir, block_indices=s, wait=False, name=f"peer{peers}-{i}")
             for i, s in enumerate(SPANS[peers])]
    for proc in procs:
        swarm.wait_ready(proc)
    out: dict = {"spans": list(SPANS[peers])}
    with contextlib.ExitStack() as stack:
        clients = {t: stack.enter_context(SwarmClient(model_dir, config=client_config(swarm, t))) for t in topologies}
        task = progress.add_task(f"{peers} peers: per-token latency", total=(len(topologies) + 1) * (args.runs + 1))
        gaps: dict[str, list[float]] = {"local": [], **{t: [] for t in topologies}}
        run_medians: dict[str, list[float]] = {name: [] for name in gaps}
        same = dict.fromkeys(topologies, True)
        for run in range(args.runs + 1):  # run 0 warms up connections and caches
            local_gaps = _intervals(local_token_times(local, input_ids))
            progress.advance(task)
            if run:
                gaps["local"] += local_gaps
                run_medians["local"].append(statistics.median(local_gaps))
            for topology, client in clients.items():
                times, tokens = swarm_token_times(client, input_ids)
                progress.advance(task)
                same[topology] &= tokens == expected
                if run:
                    gaps[topology] += _intervals(times)
                    run_medians[topology].append(statistics.median(_intervals(times)))
        ms = {name: 1e3 * statistics.median(g) for name, g in gaps.items()}
        out["per_token_latency_ms"] = {name: round(v, 2) for name, v in ms.items()}
        out["latency_over_one_process"] = {t: round(ms[t] / ms["local"], 2) for t in topologies}
        out["latency_minus_one_process_ms"] = {t: round(ms[t] - ms["local"], 2) for t in topologies}
        if "chain" in topologies and "star" in topologies:
            out["chain_over_star"] = round(ms["chain"] / ms["star"], 3)
        # the best run of each (its median gap): what this shared machine does when it has the cores
        best = {name: 1e3 * min(m) for name, m in run_medians.items()}
        out["best_run"] = {"per_token_latency_ms": {name: round(v, 2) for name, v in best.items()},
                           "latency_over_one_process": {t: round(best[t] / best["local"], 2) for t in topologies}}
        out["greedy_tokens_equal_local"] = same
        out["client_link_bytes"] = {t: link_bytes(client, meter, input_ids) for t, client in clients.items()}

        if peers == 2:
            levels = (1, 4) if args.quick else (1, 4, 16)
            task = progress.add_task("concurrent sessions", total=len(levels) * len(topologies))
            key = f"aggregate_{levels[-1]}_over_1"
            out["aggregate_tokens_per_s"], out[key] = {}, {}
            for topology, client in clients.items():
                rates = {}
                for n in levels:
                    rates[n] = concurrent_tokens_per_s(client, n)
                    progress.advance(task)
                out["aggregate_tokens_per_s"][topology] = {f"{n}_sessions": round(r, 1) for n, r in rates.items()}
                out[key][topology] = round(rates[levels[-1]] / rates[1], 2)

            task = progress.add_task("peer killed mid-generation", total=len(topologies))
            out["peer_killed_at_token_16"] = {}
            replicas = [procs[1]]
            for topology, client in clients.items():
                replicas.append(swarm.start_peer(model_dir, block_indices="4:8", name=f"replica-{topology}"))
                out["peer_killed_at_token_16"][topology] = peer_killed(client, replicas, input_ids, expected)
                progress.advance(task)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topologies", default=",".join(TOPOLOGIES), help="comma-separated: star, chain")
    parser.add_argument("--peers", default="2,4", help="comma-separated peer counts: 2, 4")
    parser.add_argument("--runs", type=int, default=None, help="timed generations per topology (default 5; quick 2)")
    parser.add_argument("--quick", action="store_true", help="2 runs, fewer sessions: a check that it works")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    args.runs = args.runs if args.runs is not None else (2 if args.quick else 5)
    topologies = [t for t in args.topologies.split(",") if t]
    peer_counts = [int(p) for p in args.peers.split(",") if p]
    if any(t not in TOPOLOGIES for t in topologies) or not topologies:
        parser.error(f"--topologies: choose from {', '.join(TOPOLOGIES)}")
    if any(p not in SPANS for p in peer_counts) or not peer_counts:
        parser.error(f"--peers: choose from {', '.join(map(str, SPANS))}")
    skipped = []
    if not has_topology():
        skipped = [t for t in topologies if t != "star"]
        topologies = ["star"]  # this checkout has no topology setting: its only data path is the star
    torch.set_num_threads(1)  # the peers use one thread each too: all share this machine's cores
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fusionswarm-bench-"))
    model_dir = make_tiny_model(workdir / "llama-bench", seed=0, **MODEL)
    local = LocalModel.from_dir(model_dir)
    result: dict = {"benchmark": "generate", "quick": args.quick, "machine": f"{platform.machine()}, "
                    f"{os.cpu_count()} cores", "model": {**MODEL, "dtype": "float32"}, "prompt": PROMPT,
                    "new_tokens": NEW, "runs": args.runs, "torch_threads_per_process": 1, "topologies": topologies,
                    "hidden_state_bytes": MODEL["hidden_size"] * 4}
    if skipped:
        result["skipped_topologies"] = {t: "this checkout's ClientConfig has no topology (star only)" for t in skipped}
    t0 = time.perf_counter()
    with LinkMeter() as meter, Progress(transient=True) as progress:
        for peers in peer_counts:
            with LocalSwarm(workdir / f"swarm-{peers}", update_period=2.0) as swarm:
                result[f"{peers}_peers"] = measure_peers(swarm, model_dir, local, peers, topologies, args, progress,
                                                         meter)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    if "chain" in topologies:
        targets = result["targets"] = {}
        if "2_peers" in result:
            targets["chain per-token latency <= 1.5x one process (2 peers)"] = \
                result["2_peers"]["latency_over_one_process"]["chain"] <= 1.5
            targets["the same, best runs"] = result["2_peers"]["best_run"]["latency_over_one_process"]["chain"] <= 1.5
        targets["chain: 2 hidden states of payload on the client's link per decode step, any number of peers"] = all(
            result[f"{p}_peers"]["client_link_bytes"]["chain"]["per_decode_step"]["payload_hidden_states"] == 2.0
            for p in peer_counts)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
