"""Star vs chain on an emulated WAN: the client behind 10 Mbit/s links, the peers on 1 Gbit/s among themselves.

    sudo python benchmarks/chain_wan.py [--topologies star,chain] [--in_flight 1,4] [--steps 5] [--runs 3]
                                        [--quick] [--out results/chain_wan.json] [--workdir DIR]

A testbed (``swarm.testbed``, root needed) of 5 hosts: h0 the bootstrap peer, h1/h2/h3 three stage peers of a tiny
Llama (hidden 256, 6 blocks, fp32: blocks 0:2, 2:4, 4:6; 1 torch thread each), h4 the client and trainer
(benchmarks/chain_wan_worker.py). Every link from or to h4 is shaped to 10 Mbit/s, every other pair to 1 Gbit/s
(each direction on its own; no latency: this kernel has no netem). ``--client_link access`` (default): h4's links
share one 10 Mbit/s upload and one 10 Mbit/s download (the client behind one access link); ``pairs``: each pair with
h4 has 10 Mbit/s of its own. Measured side by side in one run, star and
chain (``star``: every hidden state and gradient goes through h4; ``chain``: the stages push them to each other):

* generation: 8-token prompt, 32 new tokens, greedy, ``--runs`` runs interleaved; per-token latency (median gap)
  and bytes crossing h4's link per decode step (the client's streams, and h4's eth0: every packet);
* training: steps of 4 micro-batches of 4 x 64 tokens (built-in corpus), ``--in_flight`` micro-batches in flight,
  ``--steps`` steps (the first, which opens the run, not timed); tokens/s and the bytes on h4's link per token.
  Every run starts from the same step-0 checkpoint, so the losses of star and chain must be equal.

Every namespace and process is removed at the end, also on failure or Ctrl-C (the ``Testbed`` context manager).
Prints JSON and writes it to ``--out`` (not with ``--quick``: 1 run, 3 steps, a check that it works).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from report import report  # noqa: E402
from train import write_initial_state  # noqa: E402

from peers.cli.launch import LocalSwarm  # noqa: E402
from peers.model import make_tiny_model  # noqa: E402
from peers.training import OptimConfig  # noqa: E402
from swarm.testbed import Testbed, require_root  # noqa: E402
from swarm.testbed.cleanup import leftovers, nothing_left  # noqa: E402
from swarm.testbed.matrices import Matrix  # noqa: E402

MODEL = dict(family="llama", hidden_size=256, num_layers=6, num_heads=8, num_kv_heads=4, intermediate_size=688)
SPANS = [(0, 2), (2, 4), (4, 6)]
CLIENT_RATE, PEER_RATE = 10e6, 1e9
HOSTS, CLIENT = 5, 4
TOPOLOGIES = ("star", "chain")


def matrix(client_link: str) -> Matrix:
    """Every ordered pair 1 Gbit/s, but 10 Mbit/s where it touches the client's host; with ``access`` the client's
    host also has a 10 Mbit/s upload and a 10 Mbit/s download that all its pairs share (one access link, as a home
    connection), with ``pairs`` each of its pairs has 10 Mbit/s of its own (30 Mbit/s to three stages at once)."""
    def pair(i: int, j: int, n: int) -> float:
        return CLIENT_RATE if CLIENT in (i, j) else PEER_RATE

    def access(i: int, n: int) -> float | None:
        return CLIENT_RATE if i == CLIENT and client_link == "access" else None

    shared = "one 10 Mbit/s access link each way" if client_link == "access" else "10 Mbit/s per pair"
    return Matrix(f"client_10mbit_{client_link}", f"1 Gbit/s between peers; the client's host h{CLIENT}: {shared}",
                  pair=pair, up=access, down=access)


def optim(steps: int) -> dict:
    return {"lr": 3e-3, "warmup_steps": 1, "schedule": "cosine", "total_steps": steps, "clip_norm": 1.0,
            "weight_decay": 0.01}


def summarise(worker: dict, topologies: list[str]) -> dict:
    """The figures side by side: chain over star, and the targets."""
    out: dict = {}
    gen = worker.get("generate")
    if gen:
        out["per_token_latency_ms"] = gen["per_token_latency_ms"]
        out["client_bytes_per_decode_step"] = {t: v["per_decode_step"] for t, v in gen["client_link"].items()}
    train = worker.get("train", {})
    if train:
        out["training_tokens_per_s"] = {label: run["tokens_per_s"] for label, run in train.items()}
    if set(TOPOLOGIES) <= set(topologies):
        ratios: dict = {}
        if gen:
            latency = gen["per_token_latency_ms"]
            ratios["per_token_latency_chain_over_star"] = round(latency["chain"] / latency["star"], 3)
        for run in train.values():
            if run["topology"] == "chain":
                star = train[f"star, K={run['in_flight']}"]
                ratios[f"training_tokens_per_s_chain_over_star_K={run['in_flight']}"] = round(
                    run["tokens_per_s"] / star["tokens_per_s"], 3)
                ratios[f"losses_equal_K={run['in_flight']}"] = run["losses"] == star["losses"]
        out["chain_vs_star"] = ratios
        k_ratios = [v for k, v in ratios.items() if k.startswith("training_tokens_per_s_chain_over_star")]
        out["targets"] = {"chain training tokens/s >= 2x star (3 stages)": bool(k_ratios) and min(k_ratios) >= 2.0}
        if gen:
            step = gen["client_link"]["chain"]["per_decode_step"]
            out["targets"]["chain: 2 hidden states of payload per generated token"] = \
                step["payload_hidden_states"] == 2.0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topologies", default=",".join(TOPOLOGIES), help="comma-separated: star, chain")
    parser.add_argument("--in_flight", default="1,4", help="comma-separated K values (micro-batches in flight)")
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default 5; quick 3)")
    parser.add_argument("--runs", type=int, default=None, help="timed generations per topology (default 3; quick 1)")
    parser.add_argument("--client_link", choices=("access", "pairs"), default="access",
                        help="access: h4's pairs share one 10 Mbit/s link each way; pairs: 10 Mbit/s per pair")
    parser.add_argument("--quick", action="store_true", help="1 run, 3 steps: a check that it works")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "chain_wan.json")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    topologies = [t for t in args.topologies.split(",") if t]
    if not topologies or any(t not in TOPOLOGIES for t in topologies):
        parser.error(f"--topologies: choose from {', '.join(TOPOLOGIES)}")
    reason = require_root()
    if reason:
        sys.exit(f"chain_wan.py needs a testbed: {reason}")
    steps = args.steps or (3 if args.quick else 5)
    runs = args.runs or (1 if args.quick else 3)
    in_flight = [int(k) for k in args.in_flight.split(",") if k]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fusionswarm-wan-"))
    model_dir = make_tiny_model(workdir / "llama-wan", seed=0, **MODEL)
    checkpoint_dir = workdir / "checkpoints"
    for k in in_flight:
        for topology in topologies:
            write_initial_state(model_dir, checkpoint_dir, f"{topology}-k{k}", SPANS, OptimConfig(**optim(steps)))
    spec = {"model_dir": str(model_dir), "peers": len(SPANS), "topologies": topologies,
            "hidden_size": MODEL["hidden_size"],
            "generate": {"prompt": 8, "new": 32, "runs": runs},
            "train": {"in_flight": in_flight, "steps": steps, "accumulation": 4, "micro_batch": 4, "seq_len": 64,
                      "seed": 0, "optim": optim(steps)}}
    result: dict = {"benchmark": "chain_wan", "quick": args.quick, "machine": f"{platform.machine()}, "
                    f"{os.cpu_count()} cores", "model": {**MODEL, "dtype": "float32"},
                    "stages": [f"{a}:{b}" for a, b in SPANS],
                    "hosts": {"h0": "bootstrap", "h1": "0:2", "h2": "2:4", "h3": "4:6", "h4": "client and trainer"},
                    "links": matrix(args.client_link).description + "; no latency", "client_link": args.client_link,
                    "spec": {k: v for k, v in spec.items() if k not in ("model_dir",)}}
    t0 = time.perf_counter()
    prefix = f"cwan{secrets.token_hex(3)}"
    with Testbed(HOSTS, matrix(args.client_link), prefix=prefix, workdir=workdir / "tb") as tb:
        h = tb.hosts
        with LocalSwarm(workdir / "swarm", update_period=5.0, train=True) as swarm:
            swarm.start_dht(host=h[0])
            procs = [swarm.start_peer(model_dir, block_indices=f"{a}:{b}", wait=False, name=f"stage-h{i + 1}",
                                      host=h[i + 1], extra=["--checkpoint_dir", str(checkpoint_dir)])
                     for i, (a, b) in enumerate(SPANS)]
            for proc in procs:
                swarm.wait_ready(proc)
            spec.update(initial_peers=swarm.initial_peers, address=h[CLIENT].address,
                        identity_path=str(swarm.trainer_identity()))
            spec_path, out_path = workdir / "worker_spec.json", workdir / "worker_out.json"
            spec_path.write_text(json.dumps(spec))
            sent_before = {f"{a.name}->{b.name}": tb.sent_bytes(a, b) for a in h for b in h if CLIENT in
                           (a.index, b.index) and a != b}
            worker = tb.spawn(h[CLIENT], [sys.executable, str(HERE / "chain_wan_worker.py"), str(spec_path),
                                          str(out_path)], name="worker")
            try:
                worker.wait(timeout=1800)
            finally:
                log = worker.log_path.read_text(errors="replace")
            if worker.returncode != 0 or not out_path.exists():
                sys.exit(f"the worker failed (exit {worker.returncode}):\n{log[-4000:]}")
            result["shaped_bytes_MB"] = {k: round((tb.sent_bytes(*pair) - sent_before[k]) / 2**20, 2)
                                         for k, pair in ((f"{a.name}->{b.name}", (a, b)) for a in h for b in h
                                                         if CLIENT in (a.index, b.index) and a != b)}
            result["rates_bits_per_s"] = tb.describe()["rates_bits_per_s"]
            pids = tb.pids()
    result["nothing_left"] = nothing_left(leftovers(prefix, pids))
    worker_result = json.loads(out_path.read_text())
    result.update(summarise(worker_result, topologies))
    result["worker"] = worker_result
    result["seconds"] = round(time.perf_counter() - t0, 1)
    report(result, args.out, write=not args.quick)


if __name__ == "__main__":
    main()
