"""Training through 3 real stage peers, star and chain, vs the same model in one process: tokens/s and loss, as JSON.

    python benchmarks/train.py [--topologies star,chain] [--in_flight 1,2,4,8] [--no_recompute] [--quick]
                               [--steps 20] [--out results/train.json] [--workdir DIR]

Every variant trains the same model from the same initial weights on the same micro-batches (same seeds,
same number of steps, so the same number of tokens):

* one process: ``LocalTrainer`` with the same 3-stage split (per-part AdamW and clipping), torch's default
  thread count; run first and again last, and its tokens/s is the mean of the two (a guard against drift);
* the swarm with K = 1, 2, 4, 8 micro-batches in flight (``SwarmTrainer``), keeping activations on the peers;
* the swarm with K = 4 and ``recompute=True`` (stateless peers: the input travels again with the backward).

Each swarm variant runs once per topology (``--topologies``, default both; ``star``: every hidden state and
gradient goes trainer -> stage -> trainer -> next stage; ``chain``: stages push them to each other), star and
chain of one K one after the other, so that their ratio compares runs minutes apart at most. Also per variant:
the bytes crossing the trainer's link (every frame of its streams, both ways) per trained token.

The swarm is 3 peer processes (1 torch thread each) on 127.0.0.1 and the trainer in this process (1 thread),
all on this machine's cores. Each swarm variant is a new run whose stages resume from a step-0 checkpoint of
the initial weights that this script writes into the peers' ``--checkpoint_dir``, with a fresh client (new
embedding and head), so all variants start alike. tokens/s leaves out the first step (connections, warm-up).
``--quick``: a tiny model and 3 steps, only to check that the script works; nothing is written.
"""

from __future__ import annotations

import argparse
import inspect
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from report import report
from rich.progress import Progress

from peers.cli.launch import LocalSwarm
from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig
from peers.model import make_tiny_model
from peers.model.checkpoint import load_blocks
from peers.trainer.swarm_trainer import StepResult, SwarmTrainer
from peers.training import LocalTrainer, OptimConfig, PartOptimizer, TokenBatches, encode_bytes, read_corpus
from peers.training.state import save_stage_state, stage_checkpoint_path
from peers.wire.errors import RequestError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from linkbytes import LinkMeter  # noqa: E402

MODEL = dict(family="llama", hidden_size=256, num_layers=6, num_heads=8, num_kv_heads=4, intermediate_size=688)
QUICK_MODEL = dict(family="llama", hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=128)
SEED = 0  # model weights and the order of the micro-batches
LAST = 3  # "final loss" of the training curve: mean over this many last steps
EVAL_ROWS = 8  # held-out windows per forward (a peer takes at most 8 rows per request by default)
IN_FLIGHT = (1, 2, 4, 8)
RECOMPUTE_K = 4
TOPOLOGIES = ("star", "chain")


def has_topology() -> bool:
    """Whether this checkout's ``SwarmTrainer`` takes ``topology`` (before the chain landed, only the star exists)."""
    return "topology" in inspect.signature(SwarmTrainer).parameters


@dataclass(frozen=True)
class Setup:
    """Data and schedule shared by every variant."""

    seq_len: int
    micro_batch: int
    accumulation: int
    steps: int
    eval_windows: int

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.micro_batch * self.accumulation


FULL = Setup(seq_len=128, micro_batch=4, accumulation=8, steps=20, eval_windows=32)
QUICK = Setup(seq_len=32, micro_batch=2, accumulation=4, steps=3, eval_windows=8)


def optim_config(steps: int) -> OptimConfig:
    return OptimConfig(lr=3e-3, warmup_steps=2, schedule="cosine", total_steps=steps, clip_norm=1.0,
                       weight_decay=0.01)


def stage_spans(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """``stages`` contiguous spans of (nearly) equal size covering ``num_layers`` blocks."""
    cuts = [round(i * num_layers / stages) for i in range(stages + 1)]
    return list(zip(cuts, cuts[1:], strict=False))


def write_initial_state(model_dir: Path, checkpoint_dir: Path, run_id: str, spans: Sequence[tuple[int, int]],
                        optim: OptimConfig) -> None:
    """Step-0 checkpoints (the model's initial weights, empty AdamW) from which run ``run_id``'s stages start.

    A peer started with ``--checkpoint_dir checkpoint_dir`` resumes a run it opens from
    ``<checkpoint_dir>/<run_id>/blocks-<start>-<end>``, so every run written here starts from the same weights.
    """
    for start, end in spans:
        blocks = load_blocks(model_dir, start, end)
        meta = {"kind": "stage", "start": start, "end": end, "optim": optim.to_dict()}
        save_stage_state(stage_checkpoint_path(checkpoint_dir, run_id, start, end), blocks,
                         PartOptimizer(blocks.parameters(), optim).optimizer, 0, meta)


def open_run(trainer: SwarmTrainer, timeout: float = 60.0) -> None:
    """``trainer.start()``, waiting while a peer still holds the previous client's run (its stream is closing)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            trainer.start()
            return
        except RequestError as e:
            if "another trainer" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def held_out(batches: TokenBatches, windows: int) -> list[torch.Tensor]:
    """Held-out windows ``[<= EVAL_ROWS, seq_len + 1]`` in chunks (the same for every variant)."""
    ids = batches.held_out_windows(windows)
    return list(ids.split(EVAL_ROWS))


def summary(losses: list[float], tokens: list[int], seconds: list[float], eval_loss: float) -> dict:
    """tokens/s over the steps after the first, the last steps' mean loss and the held-out loss."""
    return {
        "tokens_per_s": round(sum(tokens[1:]) / sum(seconds[1:]), 1),
        "held_out_loss": eval_loss,
        f"mean_loss_last_{LAST}_steps": statistics.fmean(losses[-LAST:]),
        "step_losses": losses,  # unrounded: runs that must be identical are compared exactly
        "step_seconds": [round(s, 3) for s in seconds],
    }


def local_training(model_dir: Path, tokens: torch.Tensor, setup: Setup, spans: Sequence[tuple[int, int]],
                   advance: Callable[[], None]) -> dict:
    """The one-process reference on the same micro-batches; torch's current thread count."""
    trainer = LocalTrainer(model_dir, optim_config(setup.steps), setup.accumulation, stages=spans)
    batches = TokenBatches(tokens, setup.seq_len, setup.micro_batch, seed=SEED)
    losses, counts, seconds = [], [], []
    for _ in range(setup.steps):
        micro = [batches.next_micro() for _ in range(setup.accumulation)]
        t0 = time.perf_counter()
        losses.append(trainer.train_step(micro))
        seconds.append(time.perf_counter() - t0)
        counts.append(sum(int(m[:, 1:].numel()) for m in micro))
        advance()
    eval_loss = statistics.fmean(trainer.evaluate(ids) for ids in held_out(batches, setup.eval_windows))
    return {"torch_threads": torch.get_num_threads(), **summary(losses, counts, seconds, eval_loss)}


def swarm_training(client: SwarmClient, tokens: torch.Tensor, setup: Setup, *, in_flight: int, run_id: str,
                   advance: Callable[[], None], meter: LinkMeter, hidden_size: int, recompute: bool = False,
                   topology: str = "star") -> dict:
    """One run through the swarm (its stages must start from ``write_initial_state``); the client is fresh."""
    extra = {"topology": topology} if has_topology() else {}
    trainer = SwarmTrainer(client, optim_config(setup.steps), setup.accumulation, in_flight=in_flight,
                           run_id=run_id, recompute=recompute, **extra)
    before = meter.reading(client)
    open_run(trainer)
    batches = TokenBatches(tokens, setup.seq_len, setup.micro_batch, seed=SEED)
    results: list[StepResult] = []
    for _ in range(setup.steps):
        results.append(trainer.train_step([batches.next_micro() for _ in range(setup.accumulation)]))
        advance()
    bytes_sent = trainer.bytes_sent
    link = meter.reading(client) - before
    eval_loss = statistics.fmean(trainer.evaluate(ids) for ids in held_out(batches, setup.eval_windows))
    timed = results[1:]
    utilisation = [statistics.fmean(u) for u in zip(*(r.utilisation for r in timed), strict=True)]
    return {
        **summary([r.loss for r in results], [r.tokens for r in results], [r.seconds for r in results], eval_loss),
        "stage_utilisation": [round(u, 3) for u in utilisation],
        "stage_utilisation_sum": round(sum(utilisation), 3),
        "bytes_sent_per_token": round(bytes_sent / sum(r.tokens for r in results), 1),
        "bytes_sent_MB": round(bytes_sent / 2**20, 2),
        "trainer_link_per_token": link.per(sum(r.tokens for r in results), hidden_size),
        "trainer_link_MB": round(link.frame_bytes / 2**20, 2),
        "stage_steps": results[-1].stage_steps,
    }


def recompute_comparison(runs: dict[str, dict]) -> dict:
    keep, stateless = runs[f"K={RECOMPUTE_K}"], runs[f"K={RECOMPUTE_K}, recompute"]
    return {
        "in_flight": RECOMPUTE_K,
        "bytes_sent_MB": {"keep_activations": keep["bytes_sent_MB"], "recompute": stateless["bytes_sent_MB"]},
        "bytes_recompute_over_keep": round(stateless["bytes_sent_MB"] / keep["bytes_sent_MB"], 3),
        "tokens_per_s": {"keep_activations": keep["tokens_per_s"], "recompute": stateless["tokens_per_s"]},
        "tokens_per_s_recompute_over_keep": round(stateless["tokens_per_s"] / keep["tokens_per_s"], 3),
    }


def start_stage_peers(swarm: LocalSwarm, model_dir: Path, spans: Sequence[tuple[int, int]], checkpoint_dir: Path,
                      extra: Sequence[str] = ()) -> None:
    """A DHT and one peer per span (allowing the swarm's trainer, resuming runs from ``checkpoint_dir``), all ready."""
    swarm.start_dht()
    procs = [swarm.start_peer(model_dir, block_indices=f"{a}:{b}", wait=False, name=f"stage{i}",
                              extra=["--checkpoint_dir", str(checkpoint_dir), *extra])
             for i, (a, b) in enumerate(spans)]
    for proc in procs:
        swarm.wait_ready(proc)


def client_config(swarm: LocalSwarm, encrypt: bool = True) -> ClientConfig:
    """The swarm's trainer (the identity its peers allow with ``--trainers``)."""
    return ClientConfig(swarm=swarm.trainer_config(), encrypt=encrypt, request_timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, 3 steps: check that it works (< 1 min)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "train.json",
                        help="where the JSON goes (not written with --quick)")
    parser.add_argument("--steps", type=int, default=None, help=f"optimizer steps per variant (default {FULL.steps})")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--topologies", default=",".join(TOPOLOGIES), help="comma-separated: star, chain")
    parser.add_argument("--in_flight", default=",".join(map(str, IN_FLIGHT)),
                        help="comma-separated K values (micro-batches in flight)")
    parser.add_argument("--no_recompute", action="store_true", help="leave out the K=4 recompute variant")
    args = parser.parse_args()
    topologies = [t for t in args.topologies.split(",") if t]
    if not topologies or any(t not in TOPOLOGIES for t in topologies):
        parser.error(f"--topologies: choose from {', '.join(TOPOLOGIES)}")
    skipped = [t for t in topologies if t != "star"] if not has_topology() else []
    topologies = [t for t in topologies if t not in skipped]
    model, setup = (QUICK_MODEL, QUICK) if args.quick else (MODEL, FULL)
    if args.steps is not None:
        if args.steps < 2:
            parser.error("--steps must be at least 2 (the first step is not timed)")
        setup = replace(setup, steps=args.steps)
    default_threads = torch.get_num_threads()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fusionswarm-bench-"))
    model_dir = make_tiny_model(workdir / "llama-train", seed=SEED, **model)
    spans = stage_spans(model["num_layers"], 3)
    tokens = encode_bytes(read_corpus())
    checkpoint_dir = workdir / "checkpoints"
    in_flight_values = [int(k) for k in args.in_flight.split(",") if k]
    variants = [(f"K={k}", k, False) for k in in_flight_values]
    if not args.no_recompute:
        variants.append((f"K={RECOMPUTE_K}, recompute", RECOMPUTE_K, True))
    swarm_runs: dict[str, dict[str, dict]] = {t: {} for t in topologies}

    with LocalSwarm(workdir, update_period=10.0, train=True) as swarm, Progress(transient=True) as progress:
        def task(label: str) -> Callable[[], None]:
            task_id = progress.add_task(label, total=setup.steps)
            return lambda: progress.advance(task_id)

        start_stage_peers(swarm, model_dir, spans, checkpoint_dir)
        local_first = local_training(model_dir, tokens, setup, spans, task("one process"))
        torch.set_num_threads(1)  # the trainer's process, like each peer: they all share the machine's cores
        runs = [(label, k, recompute, topology) for label, k, recompute in variants for topology in topologies]
        with LinkMeter() as meter:
            for index, (label, in_flight, recompute, topology) in enumerate(runs):
                run_id = f"bench-{index}"
                write_initial_state(model_dir, checkpoint_dir, run_id, spans, optim_config(setup.steps))
                with SwarmClient(model_dir, config=client_config(swarm)) as client:
                    client.wait_for_records(len(spans))
                    swarm_runs[topology][label] = swarm_training(
                        client, tokens, setup, in_flight=in_flight, run_id=run_id, recompute=recompute,
                        topology=topology, meter=meter, hidden_size=model["hidden_size"],
                        advance=task(f"swarm, {topology}, {label}"))
        torch.set_num_threads(default_threads)
        local_last = local_training(model_dir, tokens, setup, spans, task("one process, again"))

    local_rate = statistics.fmean([local_first["tokens_per_s"], local_last["tokens_per_s"]])
    local_loss, local_curve = local_first["held_out_loss"], local_first[f"mean_loss_last_{LAST}_steps"]
    every_run = [run for by_label in swarm_runs.values() for run in by_label.values()]
    for run in every_run:
        run["tokens_per_s_over_one_process"] = round(run["tokens_per_s"] / local_rate, 3)
        run["held_out_loss_over_one_process"] = round(run["held_out_loss"] / local_loss, 5)
        curve = run[f"mean_loss_last_{LAST}_steps"]
        run[f"mean_loss_last_{LAST}_steps_over_one_process"] = round(curve / local_curve, 5)
    fast = [run for by_label in swarm_runs.values() for label, run in by_label.items()
            if label in {f"K={k}" for k in IN_FLIGHT if k >= 4}]
    result = {
        "benchmark": "train",
        "quick": args.quick,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "model": {**model, "dtype": "float32"},
        "stages": spans,
        "data": {**asdict(setup), "tokens_per_step": setup.tokens_per_step,
                 "tokens_trained": setup.steps * setup.tokens_per_step, "timed_steps": setup.steps - 1,
                 "corpus": "built-in (stdlib docstrings), byte tokens", "seed": SEED},
        "optim": optim_config(setup.steps).to_dict(),
        "torch_threads": {"one_process": local_first["torch_threads"], "swarm_trainer_process": 1, "each_peer": 1},
        "one_process": {"tokens_per_s": round(local_rate, 1), "tokens_per_s_first_run": local_first["tokens_per_s"],
                        "tokens_per_s_last_run": local_last["tokens_per_s"], "held_out_loss": local_loss,
                        f"mean_loss_last_{LAST}_steps": local_curve, "step_losses": local_first["step_losses"],
                        "step_seconds_first_run": local_first["step_seconds"]},
        "topologies": topologies,
        **({"skipped_topologies": {t: "this checkout's SwarmTrainer has no topology (star only)" for t in skipped}}
           if skipped else {}),
        "tokens_per_s": {t: {label: run["tokens_per_s"] for label, run in by_label.items()}
                         for t, by_label in swarm_runs.items()},
        **({"chain_over_star": {label: round(swarm_runs["chain"][label]["tokens_per_s"] / run["tokens_per_s"], 3)
                                for label, run in swarm_runs["star"].items()}} if len(swarm_runs) == 2 else {}),
        "swarm_3_stages": swarm_runs,
        **({"keep_activations_vs_recompute": {t: recompute_comparison(by_label) for t, by_label in swarm_runs.items()}}
           if not args.no_recompute and RECOMPUTE_K in in_flight_values else {}),
        "targets": {
            "K>=4 keeps >= 0.7 of one-process tokens/s": all(r["tokens_per_s_over_one_process"] >= 0.7 for r in fast),
            "held-out loss within 2% of one process": all(
                abs(r["held_out_loss_over_one_process"] - 1) <= 0.02 for r in every_run),
            "losses of every swarm run equal one process's bit for bit": all(
                r["step_losses"] == local_first["step_losses"] for r in every_run),
        },
    }
    first, last = local_first["tokens_per_s"], local_last["tokens_per_s"]
    if abs(first - last) > 0.2 * max(first, last):
        threads = local_first["torch_threads"]
        result["warning"] = (f"the two one-process runs differ ({first:.0f} vs {last:.0f} tokens/s): the machine was "
                             f"busy (a {threads}-thread process slows down many-fold when another process takes a "
                             "core); rerun on a quiet machine")
    report(result, args.out, write=not args.quick)


if __name__ == "__main__":
    main()
