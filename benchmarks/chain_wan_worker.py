"""The client/trainer of benchmarks/chain_wan.py, run inside the testbed host behind the 10 Mbit/s links.

    python benchmarks/chain_wan_worker.py SPEC.json OUT.json

SPEC says what to do (model folder, initial peers, this host's address, the trainer's identity, the topologies,
generation and training parameters). Generation: one client per topology, runs interleaved (star, chain, star,
...), per-token latency the median gap between tokens; bytes per decode step from a full and a half generation.
Training: for each K, one fresh trainer per topology, one after the other (each run's stages start from the same
step-0 checkpoint). Bytes crossing this host's link are counted twice: the client's streams (``PeerStream`` message
bytes, and the tensor payload in them) and this host's ``eth0`` (every IP packet both ways: TCP/IP headers,
libp2p's own encryption, acks and the DHT's traffic too). Writes one JSON object to OUT.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig, SwarmConfig
from peers.model import LocalModel
from peers.trainer.swarm_trainer import SwarmTrainer
from peers.training import OptimConfig, TokenBatches, encode_bytes, read_corpus

sys.path.insert(0, str(Path(__file__).resolve().parent))
from linkbytes import LinkMeter, Reading  # noqa: E402

SETTLE_S = 0.2  # after a generation whose bytes are read: its close message is sent without a reply


def eth0() -> int:
    """Bytes this host's eth0 has sent and received (the whole link, both directions)."""
    stats = Path("/sys/class/net/eth0/statistics")
    return int((stats / "rx_bytes").read_text()) + int((stats / "tx_bytes").read_text())


def client(spec: dict, topology: str, identity: str | None = None) -> SwarmClient:
    extra = {"topology": topology} if any(f.name == "topology" for f in dataclasses.fields(ClientConfig)) else {}
    swarm = SwarmConfig(initial_peers=tuple(spec["initial_peers"]), host_maddrs=(f"/ip4/{spec['address']}/tcp/0",),
                        identity_path=identity)
    made = SwarmClient(spec["model_dir"], config=ClientConfig(swarm=swarm, request_timeout=120, **extra))
    made.wait_for_records(spec["peers"], timeout=120)
    return made


def token_times(c: SwarmClient, ids: torch.Tensor, new: int) -> tuple[list[float], list[int]]:
    times, tokens = [], []
    for token in c.iter_generate(ids, new):
        times.append(time.perf_counter())
        tokens.append(int(token[0]))
    return times, tokens


def per(reading: Reading, wire: int, count: float, hidden: int) -> dict:
    return {**reading.per(count, hidden), "eth0_bytes": round(wire / count, 1),
            "eth0_hidden_states": round(wire / count / (hidden * 4), 3)}


def generation(spec: dict, meter: LinkMeter) -> dict:
    gen, hidden = spec["generate"], spec["hidden_size"]
    ids = torch.randint(0, 256, (1, gen["prompt"]), generator=torch.Generator().manual_seed(0))
    local = LocalModel.from_dir(spec["model_dir"])
    expected = local.generate_greedy(ids, gen["new"])[0, gen["prompt"]:].tolist()
    out: dict = {"prompt": gen["prompt"], "new_tokens": gen["new"], "runs": gen["runs"]}
    with contextlib.ExitStack() as stack:
        clients = {t: stack.enter_context(client(spec, t)) for t in spec["topologies"]}
        gaps: dict[str, list[float]] = {t: [] for t in clients}
        same = dict.fromkeys(clients, True)
        for run in range(gen["runs"] + 1):  # run 0 warms up the streams
            for topology, c in clients.items():
                times, tokens = token_times(c, ids, gen["new"])
                same[topology] &= tokens == expected
                if run:
                    gaps[topology] += [b - a for a, b in zip(times, times[1:], strict=False)]
        out["per_token_latency_ms"] = {t: round(1e3 * statistics.median(g), 2) for t, g in gaps.items()}
        out["greedy_tokens_equal_local"] = same
        out["client_link"] = {}
        for topology, c in clients.items():
            readings = {}
            for new in (gen["new"], gen["new"] // 2):
                before, wire = meter.reading(c), eth0()
                token_times(c, ids, new)
                time.sleep(SETTLE_S)
                readings[new] = (meter.reading(c) - before, eth0() - wire)
            (full, full_wire), (half, half_wire) = readings[gen["new"]], readings[gen["new"] // 2]
            steps = gen["new"] - gen["new"] // 2
            out["client_link"][topology] = {"per_new_token": per(full, full_wire, gen["new"], hidden),
                                            "per_decode_step": per(full - half, full_wire - half_wire, steps, hidden)}
    return out


def training(spec: dict, meter: LinkMeter) -> dict:
    tr, hidden = spec["train"], spec["hidden_size"]
    optim = OptimConfig(**tr["optim"])
    tokens = encode_bytes(read_corpus())
    takes_topology = "topology" in inspect.signature(SwarmTrainer).parameters
    out: dict = {}
    for k in tr["in_flight"]:
        for topology in spec["topologies"]:
            with client(spec, topology, spec["identity_path"]) as c:
                extra = {"topology": topology} if takes_topology else {}
                trainer = SwarmTrainer(c, optim, tr["accumulation"], in_flight=k, run_id=f"{topology}-k{k}",
                                       rechoose_every=0.0, **extra)
                before, wire = meter.reading(c), eth0()
                trainer.start()
                batches = TokenBatches(tokens, tr["seq_len"], tr["micro_batch"], seed=tr["seed"])
                steps = [trainer.train_step([batches.next_micro() for _ in range(tr["accumulation"])])
                         for _ in range(tr["steps"])]
                link, wire = meter.reading(c) - before, eth0() - wire
                trained = sum(s.tokens for s in steps)
                timed = steps[1:]  # the first step opens the run
                out[f"{topology}, K={k}"] = {
                    "topology": topology, "in_flight": k,
                    "tokens_per_s": round(sum(s.tokens for s in timed) / sum(s.seconds for s in timed), 1),
                    "step_seconds": [round(s.seconds, 3) for s in steps],
                    "losses": [s.loss for s in steps],
                    "trainer_link_per_token": per(link, wire, trained, hidden),
                    "trainer_link_MB": round(link.frame_bytes / 2**20, 2), "eth0_MB": round(wire / 2**20, 2),
                }
    return out


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    result: dict = {}
    with LinkMeter() as meter:
        if spec.get("generate"):
            result["generate"] = generation(spec, meter)
        if spec.get("train"):
            result["train"] = training(spec, meter)
    Path(sys.argv[2]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
