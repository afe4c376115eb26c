"""Why staleness 1 misses its loss target (issue 14): held-out loss of 1-step-stale training in one process.

A swarm run with ``staleness=1`` computes exactly ``LocalTrainer(staleness=1)``'s losses and weights
(``tests/integration/test_training_stale.py`` checks it bit for bit), so the loss side of asynchronous steps can be
studied here, without a testbed: the same model, data, micro-batches, stage split and optimizer as
``benchmarks/slow_links.py`` (Llama hidden 256, 3 blocks in 3 stages, byte vocabulary, fp32, 8 micro-batches of 4 x 128
tokens per step, AdamW lr 3e-3, 1 warm-up step, cosine), for staleness 0 and 1 side by side, at 30 and 80 steps, two
learning rates, and the usual remedies for delayed gradients (longer warm-up, lower beta1, higher beta2, tighter
clipping) applied to both; and the bounded overlap that ships (``stale_micro_batches`` 1: only each step's first
micro-batch runs on the old weights) at 30 and 80 steps. Every other configuration makes all 8 micro-batches of a
step stale (as staleness 1 was first built). Losses are deterministic: a loaded machine changes only how long it
takes.

    python benchmarks/staleness_study.py            # every configuration (about 10 min on 2 free cores)
    python benchmarks/staleness_study.py --quick    # 2 steps of a tiny model: a check that it runs; nothing written
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from report import report  # noqa: E402

from peers.model import make_tiny_model  # noqa: E402
from peers.training import LocalTrainer, OptimConfig, TokenBatches, encode_bytes, read_corpus  # noqa: E402

SEED = 0
MODEL = dict(family="llama", hidden_size=256, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=688)
QUICK_MODEL = dict(family="llama", hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=128)
SEQ_LEN, MICRO_BATCH, ACCUMULATION, EVAL_WINDOWS = 128, 4, 8, 64


@dataclass(frozen=True)
class Config:
    """One pair of runs (staleness 0 and 1) with these settings."""

    name: str
    steps: int = 30
    lr: float = 3e-3
    warmup: int = 1
    beta1: float = 0.9
    beta2: float = 0.95
    clip: float = 1.0
    stale: int | None = None  # staleness 1: how many of a step's micro-batches run on the old weights (None: all)


CONFIGS = [
    Config("slow_links (lr 3e-3)"),
    Config("lr 1e-3", lr=1e-3),
    Config("80 steps", steps=80),
    Config("80 steps, lr 1e-3", steps=80, lr=1e-3),
    Config("warm-up 10 steps", warmup=10),
    Config("beta1 0.5", beta1=0.5),
    Config("beta2 0.99", beta2=0.99),
    Config("clip 0.3", clip=0.3),
    Config("1 stale micro-batch per step", stale=1),
    Config("1 stale micro-batch per step, 80 steps", steps=80, stale=1),
]


def held_out(trainer: LocalTrainer, windows: torch.Tensor) -> float:
    """Mean next-token loss over ``windows`` (8 at a time)."""
    losses = [trainer.evaluate(windows[i:i + 8]) * len(windows[i:i + 8]) for i in range(0, len(windows), 8)]
    return sum(losses) / len(windows)


def train(model_dir: Path, config: Config, staleness: int, setup: dict) -> dict:
    """``config.steps`` steps from the same initial model on the same micro-batches; the held-out loss after."""
    optim = OptimConfig(lr=config.lr, warmup_steps=config.warmup, schedule="cosine", total_steps=config.steps,
                        clip_norm=config.clip, weight_decay=0.01, betas=(config.beta1, config.beta2))
    layers = setup["layers"]
    trainer = LocalTrainer(model_dir, optim, setup["accumulation"], stages=[(i, i + 1) for i in range(layers)],
                           staleness=staleness, stale_micro_batches=config.stale)
    tokens = encode_bytes(read_corpus())
    data = TokenBatches(tokens, setup["seq_len"], setup["micro_batch"], seed=SEED)
    windows = TokenBatches(tokens, setup["seq_len"], setup["micro_batch"], seed=SEED).held_out_windows(
        setup["eval_windows"])
    curve = [trainer.train_step([data.next_micro() for _ in range(setup["accumulation"])])
             for _ in range(config.steps)]
    return {"held_out_loss": round(held_out(trainer, windows), 4),
            "train_loss_every_5_steps": [round(sum(curve[i:i + 5]) / len(curve[i:i + 5]), 3)
                                         for i in range(0, len(curve), 5)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 steps, one configuration")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: runs on a shared machine "
                        "crawl when threads spin on a busy core)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "staleness_study.json")
    parser.add_argument("--only", default="", help="run only the configurations whose name contains this text")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = QUICK_MODEL if args.quick else MODEL
    setup = {"layers": spec["num_layers"], "seq_len": 32 if args.quick else SEQ_LEN,
             "micro_batch": 2 if args.quick else MICRO_BATCH, "accumulation": 2 if args.quick else ACCUMULATION,
             "eval_windows": 8 if args.quick else EVAL_WINDOWS}
    configs = [replace(CONFIGS[0], steps=2)] if args.quick else [c for c in CONFIGS if args.only in c.name]
    model_dir = make_tiny_model(Path(tempfile.mkdtemp(prefix="fusionswarm-stale-")) / "llama", seed=SEED, **spec)
    t0 = time.perf_counter()
    rows = []
    with tqdm(total=2 * len(configs), desc="staleness study", unit="run", file=sys.stderr) as bar:
        for config in configs:
            runs = {}
            for staleness in (0, 1):
                bar.set_postfix_str(f"{config.name}, staleness {staleness}")
                runs[staleness] = train(model_dir, config, staleness, setup)
                bar.update()
            gap = runs[1]["held_out_loss"] / runs[0]["held_out_loss"] - 1
            rows.append({**asdict(config), "held_out_loss_staleness_0": runs[0]["held_out_loss"],
                         "held_out_loss_staleness_1": runs[1]["held_out_loss"],
                         "staleness_1_vs_0": f"{gap:+.1%}", "within_2_percent": gap <= 0.02,
                         "train_curve_staleness_0": runs[0]["train_loss_every_5_steps"],
                         "train_curve_staleness_1": runs[1]["train_loss_every_5_steps"]})
    result = {"benchmark": "staleness_study", "quick": args.quick, "model": {**spec, "dtype": "float32"},
              "setup": setup, "seed": SEED, "torch_threads": args.threads, "runs": rows,
              "seconds": round(time.perf_counter() - t0, 1)}
    report(result, args.out, write=not args.quick)


if __name__ == "__main__":
    main()
