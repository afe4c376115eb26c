"""What end-to-end encryption costs: per-token latency, stream opening and training tokens/s, on and off, as JSON.

    python benchmarks/encryption.py [--runs 8] [--quick] [--workdir DIR]

(Not ``privacy.py``: run as a script, that name would shadow the ``privacy`` package.)

Same swarm for both modes (2 peers started with --allow_plaintext so that they accept both), measured in
one run and interleaved. Training: each round trains a few steps with encryption on and a few with it off
(in alternating order), each as a new run from the same step-0 checkpoint with a fresh client, so the two
modes must give the same losses; the figure is the median over rounds of the tokens/s ratio.
``--quick``: 2 rounds and small training micro-batches, only to check that the script works.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.progress import Progress

sys.path.insert(0, str(Path(__file__).parent))
from generate import MODEL, NEW, PROMPT, _intervals, swarm_token_times  # noqa: E402
from train import Setup, client_config, optim_config, swarm_training, write_initial_state  # noqa: E402

from peers.cli.launch import LocalSwarm  # noqa: E402
from peers.client.swarm_client import SwarmClient  # noqa: E402
from peers.core.config import ClientConfig, SwarmConfig  # noqa: E402
from peers.model import LocalModel, make_tiny_model  # noqa: E402
from peers.training import encode_bytes, read_corpus  # noqa: E402
from peers.wire.stream import PeerStream  # noqa: E402

SPANS = [(0, 4), (4, 8)]
TRAIN = Setup(seq_len=128, micro_batch=4, accumulation=4, steps=3, eval_windows=8)  # 2 timed steps per run
QUICK_TRAIN = Setup(seq_len=32, micro_batch=2, accumulation=4, steps=3, eval_windows=8)
TRAIN_IN_FLIGHT = 4


def handshake_seconds(client: SwarmClient, peer_id: str, encrypt: bool, repeats: int = 20) -> float:
    """Median time to open a stream to a peer (with the key agreement when ``encrypt``)."""

    async def once() -> float:
        t0 = time.perf_counter()
        stream = await PeerStream.connect(client.node.p2p, peer_id, encrypt=encrypt)
        if not encrypt:  # without a handshake nothing goes to the peer; ask for one reply for a fair comparison
            await stream._request(b"\x81\xa4kind\xa4ping", None, 10)
        elapsed = time.perf_counter() - t0
        stream.shutdown()
        return elapsed

    return statistics.median(client.loop.run(once()) for _ in range(repeats))


def training_on_off(swarm: LocalSwarm, model_dir: Path, checkpoint_dir: Path, setup: Setup, rounds: int,
                    progress: Progress) -> dict:
    """Training tokens/s with encryption on and off, alternated over ``rounds`` (+1 warm-up), and their losses."""
    tokens = encode_bytes(read_corpus())
    optim = optim_config(setup.steps)
    rates: dict[bool, list[float]] = {True: [], False: []}
    losses: dict[bool, list[list[float]]] = {True: [], False: []}
    ratios = []
    task = progress.add_task("training, encryption on/off", total=2 * (rounds + 1) * setup.steps)
    for run in range(rounds + 1):  # run 0 warms up
        order = (True, False) if run % 2 == 0 else (False, True)  # neither mode always goes first
        rate = {}
        for encrypt in order:
            run_id = f"encryption-{run}-{'on' if encrypt else 'off'}"
            write_initial_state(model_dir, checkpoint_dir, run_id, SPANS, optim)
            with SwarmClient(model_dir, config=client_config(swarm, encrypt)) as client:
                client.wait_for_records(len(SPANS))
                result = swarm_training(client, tokens, setup, in_flight=TRAIN_IN_FLIGHT, run_id=run_id,
                                        advance=lambda: progress.advance(task))
            rate[encrypt] = result["tokens_per_s"]
            losses[encrypt].append([*result["step_losses"], result["held_out_loss"]])
        if run:
            for encrypt in (True, False):
                rates[encrypt].append(rate[encrypt])
            ratios.append(rate[True] / rate[False])
    runs = [curve for mode in (True, False) for curve in losses[mode]]
    spread = max(abs(a - b) for curve in runs for a, b in zip(curve, runs[0], strict=True))
    ratio = statistics.median(ratios)
    return {
        "stages": SPANS, "in_flight": TRAIN_IN_FLIGHT, "rounds": rounds,
        "micro_batch": setup.micro_batch, "seq_len": setup.seq_len, "accumulation": setup.accumulation,
        "steps_per_run": setup.steps, "timed_steps_per_run": setup.steps - 1,
        "tokens_per_s_median": {"encrypted": round(statistics.median(rates[True]), 1),
                                "plaintext": round(statistics.median(rates[False]), 1)},
        "encrypted_over_plaintext_per_round": [round(r, 3) for r in ratios],
        "encrypted_over_plaintext_median": round(ratio, 3),
        "encryption_cost": f"{100 * (1 / ratio - 1):+.1f}% time per token",
        "losses_identical_on_off": spread == 0.0,
        "max_abs_loss_difference": spread,
        "step_losses_then_held_out": losses[True][0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="2 rounds, small training micro-batches")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    runs, setup = (2, QUICK_TRAIN) if args.quick else (args.runs, TRAIN)
    torch.set_num_threads(1)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fusionswarm-bench-"))
    model_dir = make_tiny_model(workdir / "llama-bench", seed=0, **MODEL)
    input_ids = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    expected = LocalModel.from_dir(model_dir).generate_greedy(input_ids, NEW)[0, PROMPT:].tolist()
    with LocalSwarm(workdir, update_period=10.0, train=True) as swarm, Progress(transient=True) as progress:
        swarm.start_dht()
        checkpoint_dir = workdir / "checkpoints"
        procs = [swarm.start_peer(model_dir, block_indices=f"{a}:{b}", wait=False,
                                  extra=["--allow_plaintext", "--checkpoint_dir", str(checkpoint_dir)])
                 for a, b in SPANS]
        for proc in procs:
            swarm.wait_ready(proc)
        clients = {
            encrypt: SwarmClient(model_dir, config=ClientConfig(
                swarm=SwarmConfig(initial_peers=tuple(swarm.initial_peers)), encrypt=encrypt))
            for encrypt in (True, False)
        }
        try:
            gaps, same = {True: [], False: []}, True
            task = progress.add_task("per-token latency, encryption on/off", total=2 * (runs + 1))
            for run in range(runs + 1):  # run 0 warms up
                for encrypt, client in clients.items():
                    times, tokens = swarm_token_times(client, input_ids)
                    same &= tokens == expected
                    if run:
                        gaps[encrypt] += _intervals(times)
                    progress.advance(task)
            on, off = (1e3 * statistics.median(gaps[e]) for e in (True, False))
            handshake = {e: 1e3 * handshake_seconds(clients[e], procs[0].peer_id, e) for e in (True, False)}
        finally:
            for client in clients.values():
                client.close()
        training = training_on_off(swarm, model_dir, checkpoint_dir, setup, runs, progress)
    print(json.dumps({
        "benchmark": "encryption",
        "model": {**MODEL, "dtype": "float32"}, "peers": 2, "prompt": PROMPT, "new_tokens": NEW, "runs": runs,
        "per_token_latency_ms": {"encrypted": round(on, 2), "plaintext": round(off, 2),
                                 "encryption_cost": f"{100 * (on / off - 1):+.1f}%"},
        "stream_open_ms": {"with_handshake": round(handshake[True], 2), "plain_round_trip": round(handshake[False], 2)},
        "tokens_equal_local_both_modes": same,
        "training": training,
    }, indent=2))


if __name__ == "__main__":
    main()
