"""Link measurement on 127.0.0.1, as JSON: the router's network-only round trip against the hop's wall time for a
peer whose compute dominates, and what a joining peer's probes publish.

    python benchmarks/links.py [--tokens 32] [--workdir DIR]

Part 1: one peer serving two wide blocks (hidden 1024); the client generates ``--tokens`` tokens and reports, per
step, the hop's wall time, the compute the peer reported and the router's estimate (the old router used an EMA of
the wall time, so it counted the compute twice). Part 2: peers 0:4 and 4:8 of a tiny Llama, then a joiner 0:8:
the seconds from its start to its record listing its links, and the links. Loopback's bandwidth is the p2p daemon's
(~240 MB/s, /work/shared/research/substrate.md), not a link's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from rich.progress import Progress

from peers.cli.launch import LocalSwarm
from peers.client.swarm_client import SwarmClient
from peers.model import make_tiny_model

WIDE = dict(family="llama", hidden_size=1024, num_layers=2, num_heads=8, num_kv_heads=4, intermediate_size=2048)
TINY = dict(family="llama", hidden_size=64, num_layers=8, num_heads=4, num_kv_heads=2, intermediate_size=128)


def network_only(workdir: Path, tokens: int, progress: Progress) -> dict:
    model = make_tiny_model(workdir / "wide", seed=3, **WIDE)
    task = progress.add_task("compute-heavy peer", total=3)
    with LocalSwarm(workdir / "swarm1", update_period=2.0) as swarm:
        swarm.start_dht()
        peer = swarm.start_peer(model, block_indices="0:2")
        progress.advance(task)
        with SwarmClient(model, initial_peers=swarm.initial_peers) as client:
            client.wait_for_records(1)
            client.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=tokens)
            progress.advance(task)
            state = client.router.links.links[peer.peer_id]
            walls = [w for w, _ in state.recent]
            computes = [c for _, c in state.recent]
            old = walls[0]
            for wall in walls[1:]:
                old = 0.8 * old + 0.2 * wall  # the old router: an EMA of the whole hop time
            record = client.records()[0]
            progress.advance(task)
            return {
                "samples": len(walls), "hop_wall_ms_median": 1e3 * statistics.median(walls),
                "reported_compute_ms_median": 1e3 * statistics.median(computes),
                "router_rtt_ms": 1e3 * client.router.rtt[peer.peer_id], "old_router_rtt_ms": 1e3 * old,
                "record_forward_ms_per_token_per_block": 1e3 * record.forward_seconds,
                "record_backward_ms_per_token_per_block": 1e3 * record.backward_seconds,
            }


def joiner_links(workdir: Path, progress: Progress) -> dict:
    model = make_tiny_model(workdir / "tiny", seed=1, **TINY)
    task = progress.add_task("joiner probes", total=4)
    with LocalSwarm(workdir / "swarm2", update_period=1.0) as swarm:
        swarm.start_dht()
        others = [swarm.start_peer(model, block_indices=span) for span in ("0:4", "4:8")]
        progress.advance(task, 2)
        started = time.monotonic()
        joiner = swarm.start_peer(model, block_indices="0:8")
        ready = time.monotonic()
        progress.advance(task)
        with SwarmClient(model, initial_peers=swarm.initial_peers) as client:
            while time.monotonic() - started < 60:
                record = next((r for r in client.records() if r.peer_id == joiner.peer_id), None)
                if record is not None and len(record.links) >= len(others):
                    break
                time.sleep(0.2)
            seen = time.monotonic()
        progress.advance(task)
        return {
            "seconds_start_to_serving": ready - started, "seconds_serving_to_links_in_record": seen - ready,
            "links": [{"peer": row.peer_id[-6:], "mbit_s": row.bandwidth / 1e6, "rtt_ms": row.rtt * 1e3,
                       "source": row.source} for row in (record.links if record else ())],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="fusionswarm-links-") as tmp, Progress() as progress:
        workdir = args.workdir or Path(tmp)
        result = {"network_only": network_only(workdir, args.tokens, progress),
                  "joiner": joiner_links(workdir, progress)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
