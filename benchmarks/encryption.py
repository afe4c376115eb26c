"""What end-to-end encryption costs: per-token latency with it on and off, and the handshake time, as JSON.

    python benchmarks/encryption.py [--runs 8] [--workdir DIR]

(Not ``privacy.py``: run as a script, that name would shadow the ``privacy`` package.)

Same swarm for both modes (2 peers started with --allow_plaintext so that they accept both), measured in
one run and interleaved. Training through the swarm does not exist yet, so there is no training figure.
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

from peers.client import SwarmClient  # noqa: E402
from peers.config import ClientConfig, SwarmConfig  # noqa: E402
from peers.launch import LocalSwarm  # noqa: E402
from peers.model import LocalModel, make_tiny_model  # noqa: E402
from peers.peer_stream import PeerStream  # noqa: E402


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fusionswarm-bench-"))
    model_dir = make_tiny_model(workdir / "llama-bench", seed=0, **MODEL)
    input_ids = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    expected = LocalModel.from_dir(model_dir).generate_greedy(input_ids, NEW)[0, PROMPT:].tolist()
    with LocalSwarm(workdir, update_period=2.0) as swarm, Progress(transient=True) as progress:
        swarm.start_dht()
        procs = [swarm.start_peer(model_dir, block_indices=s, wait=False, extra=["--allow_plaintext"])
                 for s in ("0:4", "4:8")]
        for proc in procs:
            swarm.wait_ready(proc)
        clients = {
            encrypt: SwarmClient(model_dir, config=ClientConfig(
                swarm=SwarmConfig(initial_peers=tuple(swarm.initial_peers)), encrypt=encrypt))
            for encrypt in (True, False)
        }
        try:
            gaps, same = {True: [], False: []}, True
            task = progress.add_task("per-token latency, encryption on/off", total=2 * (args.runs + 1))
            for run in range(args.runs + 1):  # run 0 warms up
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
    print(json.dumps({
        "benchmark": "encryption",
        "model": {**MODEL, "dtype": "float32"}, "peers": 2, "prompt": PROMPT, "new_tokens": NEW, "runs": args.runs,
        "per_token_latency_ms": {"encrypted": round(on, 2), "plaintext": round(off, 2),
                                 "encryption_cost": f"{100 * (on / off - 1):+.1f}%"},
        "stream_open_ms": {"with_handshake": round(handshake[True], 2), "plain_round_trip": round(handshake[False], 2)},
        "tokens_equal_local_both_modes": same,
        "training_tokens_per_s": "n/a: training through the swarm is not implemented yet",
    }, indent=2))


if __name__ == "__main__":
    main()
