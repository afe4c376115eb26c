"""Where a generation step's time goes, star vs chain: when each hop's request leaves the client and its reply comes.

    python benchmarks/chain_timeline.py [--peers 2|4] [--rounds 2] [--tokens 48]

A diagnostic for generate.py's latency figures (nothing here is a target). Tiny Llama (hidden 256, 8 blocks) on 2
peers (0:4, 4:8) or 4 (0:2, ...) on 127.0.0.1; for each topology in turn (``--rounds`` times, a fresh client each),
a 48-token greedy generation after a warm-up one. The client's streams are watched (``PeerStream._flush`` and
``_deliver`` wrapped): per decode step, the time from the step's first request (to hop 0) until each hop's request
left (``send``) and its reply arrived (``reply``), and the compute each hop reported (``compute``: 0 where a chained
hop's reply does not report it). Medians over the steps; JSON on stdout.

In the star, hop i's request leaves once hop i-1's reply is back. In the chain every request leaves at once (only
hop 0's carries a tensor); hop i > 0 starts when hop i-1's push arrives, and hop i-1 replies once the push is acked.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import peers.wire.stream as stream_module
from peers.cli.launch import LocalSwarm
from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig, SwarmConfig
from peers.model import make_tiny_model

MODEL = dict(family="llama", hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=688)
SPANS = {2: ("0:4", "4:8"), 4: ("0:2", "2:4", "4:6", "6:8")}
EVENTS: list[tuple[str, str, float, float | None]] = []  # (send | reply, peer id, perf_counter, compute s)


def watch_streams() -> None:
    flush, deliver = stream_module.PeerStream._flush, stream_module.PeerStream._deliver

    def watched_flush(self) -> None:
        if self._pending and not self._in_flight and not self.closed:
            EVENTS.append(("send", self.peer_id, time.perf_counter(), None))
        flush(self)

    def watched_deliver(self, done, group) -> None:
        ok = not done.cancelled() and done.exception() is None
        EVENTS.append(("reply", self.peer_id, time.perf_counter(), done.result()[0].compute_ms / 1e3 if ok else None))
        deliver(self, done, group)

    stream_module.PeerStream._flush = watched_flush  # type: ignore[method-assign]
    stream_module.PeerStream._deliver = watched_deliver  # type: ignore[method-assign]


def timeline(order: dict[str, int]) -> dict:
    """Median per-step offsets (ms) from the step's request to hop 0."""
    steps: list[dict] = []
    for kind, peer, at, compute in EVENTS:
        hop = order.get(peer)
        if hop is None:
            continue
        if kind == "send" and hop == 0:
            steps.append({"t0": at})
        if not steps:
            continue
        steps[-1].setdefault(f"{kind}_{hop}", at - steps[-1]["t0"])
        if compute is not None:
            steps[-1][f"compute_{hop}"] = compute
    steps = steps[2:-1]  # the prompt's step and the first decode step; the last may be cut
    keys = sorted({k for s in steps for k in s if k != "t0"}, key=lambda k: (int(k.split("_")[1]), k))
    return {k: round(1e3 * statistics.median(s[k] for s in steps if k in s), 2) for k in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, choices=sorted(SPANS), default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(1)
    watch_streams()
    workdir = Path(tempfile.mkdtemp(prefix="fusionswarm-bench-"))
    model_dir = make_tiny_model(workdir / "llama-bench", seed=0, **MODEL)
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    result: dict = {"benchmark": "chain_timeline", "peers": args.peers, "spans": SPANS[args.peers], "rounds": []}
    with LocalSwarm(workdir, update_period=2.0) as swarm:
        swarm.start_dht()
        procs = [swarm.start_peer(model_dir, block_indices=s, wait=False) for s in SPANS[args.peers]]
        for proc in procs:
            swarm.wait_ready(proc)
        order = {proc.peer_id: i for i, proc in enumerate(procs)}
        for _ in range(args.rounds):
            for topology in ("star", "chain"):
                config = ClientConfig(swarm=SwarmConfig(initial_peers=tuple(swarm.initial_peers)),
                                      request_timeout=10, topology=topology)
                with SwarmClient(model_dir, config=config) as client:
                    list(client.iter_generate(ids, 16))
                    EVENTS.clear()
                    stamps = [time.perf_counter() for _ in client.iter_generate(ids, args.tokens)]
                    gaps = [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]
                    result["rounds"].append({"topology": topology,
                                             "per_token_latency_ms": round(1e3 * statistics.median(gaps), 2),
                                             "step_ms": timeline(order)})
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
