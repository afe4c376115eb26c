"""Training over slow links (issue 14): compression and staleness on an emulated WAN, side by side in one run.

    sudo python benchmarks/slow_links.py [--configs none/0,none/1,fp16/0,int8/0,adaptive/0,adaptive:1/0,adaptive/1]
                                         [--steps 10] [--quick] [--out results/slow_links.json] [--workdir DIR]

A testbed (``swarm.testbed``, root needed) of 5 hosts: h0 the bootstrap peer, h1/h2/h3 three stage peers in chain
topology (blocks 0:1, 1:2, 2:3), h4 the trainer (benchmarks/slow_links_worker.py). The matrix ``one_slow_link``:
h1 <-> h2 (stage 1 -> stage 2 and its gradients back) 8 Mbit/s each way, every other pair 100 Mbit/s (stage 2 ->
stage 3, the trainer's host, the bootstrap peer); no latency (this kernel has no netem). Why this matrix and not
``three_sites``: on these 5 hosts it makes stage 1 -> stage 2 100 Mbit/s, stage 2 -> stage 3 10 Gbit/s and
only the trainer's host 8 Mbit/s (alone in site-c), so the only slow link would be the trainer's, which the chain
topology already keeps to one hidden state each way; compression of the stage-to-stage pushes needs a slow link
*between two stages*, and one named slow link makes the bottleneck known: every hidden state and gradient of every
micro-batch crosses it exactly once.

Model: Llama, hidden 256, 3 blocks (1 per stage), 4 heads (2 KV), MLP 688, byte vocabulary, fp32; micro-batches
of 4 x 128 tokens, 8 per step, 4 in flight, 10 steps (40,960 training tokens per run); 1 torch thread per peer. A
hidden state (or its gradient) of a micro-batch is 4*128*256*4 bytes = 0.5 MiB: ~0.55 s at 8 Mbit/s (95% goodput),
~0.04 s at 100 Mbit/s, against ~0.06-0.08 s of one block's forward + backward per micro-batch (``compute_vs_transfer``
in the JSON: the stages' measured busy time per micro-batch in the run), so the slow link binds uncompressed by ~4x
even with the 3 stages and the trainer sharing 2 cores. Why not hidden 512 (an earlier version of this benchmark):
a transfer grows with the hidden size and compute with its square, and at 512 the 2 shared cores, not the link,
bound every configuration once both directions of the slow link carried traffic at once (stages used to compute
forwards and backwards in one order, which kept one direction idle at a time).

Configurations (``--configs``, ``COMPRESSION/STALENESS``): ``TrainConfig.compression`` "none" | "fp16" | "int8" |
"adaptive" (AdaTopK) and ``TrainConfig.staleness`` 0 | 1 | 1all (1: the first micro-batch of each step starts while
the previous step drains, ``stale_micro_batches`` 1, the default; 1all: all of them, as staleness 1 was first built),
passed to ``SwarmTrainer`` as keyword arguments; one a
checkout does not have yet is skipped and the JSON says why. Every configuration is its own run (its own run id)
whose stages start from the same step-0 checkpoint of the same initial weights (``train.write_initial_state``), with
a fresh trainer (the same initial embedding and head) on the same micro-batches (same seed, same number of steps:
equal training tokens). Per configuration: tokens/s over the steps after the first (which opens the run), by wall
clock from its end (steps overlap with staleness 1), bytes on the slow link (both directions, from the shaper's
counters), and the held-out loss: the stages save their final weights (``checkpoint_every`` = steps), the trainer
its embedding and head, and this script loads them into one ``peers.model.LocalModel`` and computes the mean
next-token loss on held-out windows of the corpus (its last 5%, never trained on) exactly, without compression. The
summary compares each configuration with "none/0" (tokens/s ratio, relative held-out loss) and staleness 1 with 0 at
the same compression, against the issue's targets.

Every namespace and process is removed at the end, also on failure or Ctrl-C (the ``Testbed`` context manager);
``nothing_left`` in the JSON checks it. ``--quick``: a tiny model, 2 steps, the pair none/0 and adaptive/0 (the
second skipped where it does not exist), no wait for the link probes: a check that it works; nothing is written.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from report import report  # noqa: E402
from train import write_initial_state  # noqa: E402

from peers.cli.launch import LocalSwarm  # noqa: E402
from peers.model import LocalModel, make_tiny_model  # noqa: E402
from peers.trainer.state import trainer_checkpoint_path  # noqa: E402
from peers.training import OptimConfig, TokenBatches, encode_bytes, loss_of, read_corpus  # noqa: E402
from peers.training.state import client_part, load_weights, read_state_info, stage_checkpoint_path  # noqa: E402
from swarm.testbed import MBIT, Testbed, require_root  # noqa: E402
from swarm.testbed.cleanup import leftovers, nothing_left  # noqa: E402
from swarm.testbed.matrices import Matrix  # noqa: E402

MODEL = dict(family="llama", hidden_size=256, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=688)
QUICK_MODEL = dict(family="llama", hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=128)
SLOW, FAST = 8 * MBIT, 100 * MBIT
HOSTS, TRAINER, SLOW_PAIR = 5, 4, (1, 2)  # h0 bootstrap, h1-h3 stages, h4 trainer; h1 <-> h2 is the slow link
CONFIGS = "none/0,none/1,fp16/0,int8/0,adaptive/0,adaptive:1/0,adaptive/1"
QUICK_CONFIGS = "none/0,adaptive/0"
COMPRESSIONS = ("none", "fp16", "int8", "adaptive", "adaptive:1")  # adaptive:1: top-k as soon as int8 does not fit
GOODPUT = 0.95  # TCP payload over wire rate at MTU 1500 (swarm.testbed)
LOSS_TOLERANCE = 0.02
PROBE_WAIT_S = 150.0  # the targets: held-out loss within 2% of the reference's


@dataclass(frozen=True)
class Setup:
    seq_len: int
    micro_batch: int
    accumulation: int
    in_flight: int
    steps: int
    eval_windows: int


FULL = Setup(seq_len=128, micro_batch=4, accumulation=8, in_flight=4, steps=10, eval_windows=64)
QUICK = Setup(seq_len=32, micro_batch=2, accumulation=2, in_flight=2, steps=2, eval_windows=8)
SEED = 0


def one_slow_link() -> Matrix:
    """8 Mbit/s each way between stage 1's host and stage 2's, 100 Mbit/s for every other ordered pair."""
    def pair(i: int, j: int, n: int) -> float:
        return SLOW if {i, j} == set(SLOW_PAIR) else FAST

    return Matrix("one_slow_link", "h1 <-> h2 (stage 1 <-> stage 2) 8 Mbit/s each way, every other pair 100 Mbit/s",
                  pair=pair)


def wait_for_probes(logs: list[Path], timeout: float) -> dict[str, list[str]]:
    """Wait until every stage peer has probed its link to every other stage (``peers.server.prober``: a first
    round when it joins, the next about a minute later), so that no probe's 1 MiB crosses the slow link during a
    timed run and every stage knows its links' bandwidth; returns each log's probe lines (what they measured)."""
    deadline = time.monotonic() + timeout
    while True:
        found = {p.stem: [line.split("prober: ", 1)[-1] for line in p.read_text(errors="replace").splitlines()
                          if "(probe)" in line] for p in logs}
        if all(len(lines) >= len(logs) - 1 for lines in found.values()) or time.monotonic() > deadline:
            return found
        time.sleep(2.0)


def optim(steps: int) -> dict:
    return {"lr": 3e-3, "warmup_steps": 1, "schedule": "cosine", "total_steps": steps, "clip_norm": 1.0,
            "weight_decay": 0.01}


STALENESS = ("0", "1", "1all")


def parse_configs(text: str) -> list[tuple[str, str]]:
    """``"none/0,adaptive/1"`` -> [("none", "0"), ("adaptive", "1")]; ValueError saying what is allowed."""
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        compression, _, stale = item.partition("/")
        if compression not in COMPRESSIONS or stale not in STALENESS:
            raise ValueError(f"--configs: {item!r} is not COMPRESSION/STALENESS with COMPRESSION one of "
                             f"{', '.join(COMPRESSIONS)} and STALENESS one of {', '.join(STALENESS)}")
        out.append((compression, stale))
    if not out or len(set(out)) != len(out):
        raise ValueError("--configs: give at least one configuration, each once")
    return out


def label(compression: str, staleness: str) -> str:
    return f"{compression}/{staleness}"


def run_id(compression: str, staleness: str) -> str:
    return f"slow-{compression}-s{staleness}"


def final_model(model_dir: Path, checkpoint_dir: Path, run: str, spans: list[tuple[int, int]]) -> LocalModel:
    """The run's trained weights in one ``LocalModel``: each stage's saved blocks and the trainer's embedding + head."""
    model = LocalModel.from_dir(model_dir)
    load_weights(trainer_checkpoint_path(checkpoint_dir, run), client_part(model.embedding, model.head))
    for start, end in spans:
        load_weights(stage_checkpoint_path(checkpoint_dir, run, start, end), model.blocks[start:end])
    return model.eval()


def held_out_loss(model: LocalModel, windows: torch.Tensor, rows: int = 8) -> float:
    """Mean next-token loss over ``windows`` (each window weighs the same)."""
    total = 0.0
    with torch.no_grad():
        for chunk in windows.split(rows):
            total += loss_of(model(chunk)[0], chunk).item() * len(chunk)
    return total / len(windows)


def stage_steps(checkpoint_dir: Path, run: str, spans: list[tuple[int, int]]) -> list[int]:
    return [int(read_state_info(stage_checkpoint_path(checkpoint_dir, run, a, b))["step"]) for a, b in spans]


def compute_vs_transfer(run: dict, setup: Setup, hidden: int) -> dict:
    """Each stage's compute per micro-batch (median over the timed steps of its busy seconds) and the time one
    fp32 hidden state of a micro-batch takes on the slow and the fast link."""
    busy = list(zip(*run["stage_busy_s"][1:], strict=True)) if len(run["stage_busy_s"]) > 1 else []
    state_bytes = setup.micro_batch * setup.seq_len * hidden * 4
    return {
        "stage_compute_s_per_micro_batch": [round(statistics.median(b) / setup.accumulation, 3) for b in busy],
        "hidden_state_MiB": round(state_bytes / 2**20, 3),
        "transfer_s_8mbit": round(state_bytes * 8 / (SLOW * GOODPUT), 3),
        "transfer_s_100mbit": round(state_bytes * 8 / (FAST * GOODPUT), 3),
    }


def summarise(runs: dict[str, dict]) -> dict:
    """Each configuration against none/0, staleness 1 against 0, and the issue's targets (None: not measured)."""
    done = {k: v for k, v in runs.items() if "tokens_per_s" in v and "held_out_loss" in v}
    out: dict = {"tokens_per_s": {k: v["tokens_per_s"] for k, v in done.items()},
                 "held_out_loss": {k: round(v["held_out_loss"], 4) for k, v in done.items()},
                 "not_run": {k: v.get("skipped") or v.get("error") for k, v in runs.items() if k not in done}}
    ref = done.get("none/0")
    if ref:
        out["vs_none"] = {k: {"speedup": round(v["tokens_per_s"] / ref["tokens_per_s"], 2),
                              "held_out_loss_rel": round(v["held_out_loss"] / ref["held_out_loss"] - 1, 4)}
                          for k, v in done.items() if k != "none/0"}
    stale = {}
    for key, v in done.items():
        compression, _, s = key.partition("/")
        base = done.get(f"{compression}/0")
        if s != "0" and base:
            name = compression if s == "1" else f"{compression} ({s})"
            stale[name] = {"speedup": round(v["tokens_per_s"] / base["tokens_per_s"], 2),
                           "held_out_loss_rel": round(v["held_out_loss"] / base["held_out_loss"] - 1, 4)}
    out["staleness_1_vs_0"] = stale

    def target(key: str, min_speedup: float, against: dict | None) -> bool | None:
        if against is None or key not in against:
            return None
        v = against[key]
        return v["speedup"] >= min_speedup and abs(v["held_out_loss_rel"]) <= LOSS_TOLERANCE

    out["targets"] = {
        "AdaTopK >= 3x uncompressed tokens/s, held-out loss within 2%": target("adaptive/0", 3.0, out.get("vs_none")),
        "AdaTopK, strict (adaptive:1) >= 3x uncompressed tokens/s, held-out loss within 2%":
            target("adaptive:1/0", 3.0, out.get("vs_none")),
        "staleness 1 faster than 0 where the slow link binds (uncompressed), held-out loss within 2%":
            target("none", 1.0 + 1e-9, stale),
        "staleness 1 faster than 0 with AdaTopK, held-out loss within 2%": target("adaptive", 1.0 + 1e-9, stale),
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=None, help=f"comma-separated COMPRESSION/STALENESS (default {CONFIGS})")
    parser.add_argument("--steps", type=int, default=None, help=f"steps per run (default {FULL.steps}; quick 2)")
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 steps, none/0 and adaptive/0")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "slow_links.json")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    try:
        configs = parse_configs(args.configs or (QUICK_CONFIGS if args.quick else CONFIGS))
    except ValueError as e:
        parser.error(str(e))
    reason = require_root()
    if reason:
        sys.exit(f"slow_links.py needs a testbed: {reason}")
    model_spec, setup = (QUICK_MODEL, QUICK) if args.quick else (MODEL, FULL)
    if args.steps is not None:
        if args.steps < 2:
            parser.error("--steps must be at least 2 (the first step is not timed)")
        setup = Setup(**{**setup.__dict__, "steps": args.steps})
    layers = model_spec["num_layers"]
    spans = [(round(i * layers / 3), round((i + 1) * layers / 3)) for i in range(3)]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fusionswarm-slow-"))
    model_dir = make_tiny_model(workdir / "llama-slow", seed=SEED, **model_spec)
    checkpoint_dir = workdir / "checkpoints"
    for compression, staleness in configs:
        write_initial_state(model_dir, checkpoint_dir, run_id(compression, staleness), spans,
                            OptimConfig(**optim(setup.steps)))
    train = {"steps": setup.steps, "accumulation": setup.accumulation, "micro_batch": setup.micro_batch,
             "seq_len": setup.seq_len, "in_flight": setup.in_flight, "seed": SEED, "optim": optim(setup.steps)}
    matrix = one_slow_link()
    result: dict = {"benchmark": "slow_links", "quick": args.quick,
                    "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                    "model": {**model_spec, "dtype": "float32"}, "stages": [f"{a}:{b}" for a, b in spans],
                    "hosts": {"h0": "bootstrap", "h1": "stage 1", "h2": "stage 2", "h3": "stage 3", "h4": "trainer"},
                    "matrix": matrix.name, "links": matrix.description + "; no latency", "topology": "chain",
                    "train": train, "tokens_per_run": setup.steps * setup.accumulation * setup.micro_batch
                    * setup.seq_len, "held_out_windows": setup.eval_windows}
    t0 = time.perf_counter()
    runs: dict[str, dict] = {}
    prefix = f"slow{secrets.token_hex(3)}"
    with Testbed(HOSTS, matrix, prefix=prefix, workdir=workdir / "tb") as tb:
        h = tb.hosts
        slow = [(h[a], h[b]) for a, b in (SLOW_PAIR, SLOW_PAIR[::-1])]
        with LocalSwarm(workdir / "swarm", update_period=5.0, train=True) as swarm:
            swarm.start_dht(host=h[0])
            procs = [swarm.start_peer(model_dir, block_indices=f"{a}:{b}", wait=False, name=f"stage-h{i + 1}",
                                      host=h[i + 1], extra=["--checkpoint_dir", str(checkpoint_dir)])
                     for i, (a, b) in enumerate(spans)]
            for proc in procs:
                swarm.wait_ready(proc)
            print("[slow_links] waiting for the stages' link probes", file=sys.stderr, flush=True)
            result["link_probes"] = wait_for_probes([p.log_path for p in procs], 0.0 if args.quick else PROBE_WAIT_S)
            base = {"model_dir": str(model_dir), "peers": len(spans), "initial_peers": swarm.initial_peers,
                    "address": h[TRAINER].address, "identity_path": str(swarm.trainer_identity()),
                    "checkpoint_dir": str(checkpoint_dir), "train": train}
            for compression, staleness in configs:
                key, run = label(compression, staleness), run_id(compression, staleness)
                spec_path, out_path = workdir / f"{run}.spec.json", workdir / f"{run}.out.json"
                spec_path.write_text(json.dumps({**base, "run_id": run, "compression": compression,
                                                 "staleness": staleness}))
                before = [tb.sent_bytes(a, b) for a, b in slow]
                print(f"[slow_links] {key}: training {setup.steps} steps", file=sys.stderr, flush=True)
                worker = tb.spawn(h[TRAINER], [sys.executable, str(HERE / "slow_links_worker.py"), str(spec_path),
                                               str(out_path)], name=f"trainer-{run}")
                worker.wait(timeout=1800)
                if worker.returncode != 0 or not out_path.exists():
                    log = worker.log_path.read_text(errors="replace")
                    runs[key] = {"error": f"the trainer failed (exit {worker.returncode}): {log[-2000:]}"}
                    continue
                runs[key] = json.loads(out_path.read_text())
                sent = [tb.sent_bytes(a, b) - x for (a, b), x in zip(slow, before, strict=True)]
                if "skipped" not in runs[key]:
                    runs[key]["slow_link_MB"] = {"h1->h2": round(sent[0] / 2**20, 2),
                                                 "h2->h1": round(sent[1] / 2**20, 2)}
            result["rates_bits_per_s"] = tb.describe()["rates_bits_per_s"]
            pids = tb.pids()
    result["nothing_left"] = nothing_left(leftovers(prefix, pids))
    result["seconds_testbed"] = round(time.perf_counter() - t0, 1)
    torch.manual_seed(SEED)
    windows = TokenBatches(encode_bytes(read_corpus()), setup.seq_len, setup.micro_batch,
                           seed=SEED).held_out_windows(setup.eval_windows)
    result["held_out_loss_initial"] = round(held_out_loss(LocalModel.from_dir(model_dir), windows), 4)
    for compression, staleness in configs:
        run = runs[label(compression, staleness)]
        if "tokens_per_s" in run:
            rid = run_id(compression, staleness)
            run["stage_checkpoint_steps"] = stage_steps(checkpoint_dir, rid, spans)
            run["held_out_loss"] = held_out_loss(final_model(model_dir, checkpoint_dir, rid, spans), windows)
    reference = runs.get("none/0")
    if reference and "stage_busy_s" in reference:
        result["compute_vs_transfer"] = compute_vs_transfer(reference, setup, model_spec["hidden_size"])
    result.update(summarise(runs))
    result["runs"] = runs
    result["seconds"] = round(time.perf_counter() - t0, 1)
    report(result, args.out, write=not args.quick)


if __name__ == "__main__":
    main()
