"""Issue 11's "done when": 6 hosts on ``three_sites``, a bootstrap peer, three stage peers, a client and a trainer
in hosts (processes in the namespaces); generation and training through the shaped links equal one process, and
everything is removed afterwards.

Sites: a = h0 (bootstrap), h1 (blocks 0:3); b = h2 (3:6), h3 (client); c = h4 (6:8), h5 (trainer). Every hop of
the chain crosses an 8 or 100 Mbit/s link: client h3 -> h1 (100) -> h2 (100) -> h4 (8) -> h3 (8);
trainer h5 -> h1 (8) -> h2 (100) -> h4 (8) -> h5 (10G).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from peers.cli.launch import LocalSwarm
from peers.model import LocalModel
from peers.training import LocalTrainer, OptimConfig, TokenBatches, encode_bytes
from swarm.testbed import Testbed
from swarm.testbed.cleanup import leftovers, nothing_left
from swarm.testbed.netns import pids_in_netns

JOBS = Path(__file__).with_name("wan_jobs.py")
SPANS = {"h1": "0:3", "h2": "3:6", "h4": "6:8"}
OPTIM = {"lr": 3e-3, "warmup_steps": 1, "schedule": "cosine", "total_steps": 4, "clip_norm": 1.0,
         "weight_decay": 0.01}
TEXT = "A swarm of ordinary computers trains one model together, across slow links and fast ones. " * 40
TRAIN = {"steps": 3, "accumulation": 2, "seq_len": 16, "micro_batch": 2, "seed": 1}


def _job(tb: Testbed, host, kind: str, spec: dict, path: Path) -> subprocess.Popen:
    path.write_text(json.dumps(spec))
    return tb.spawn(host, [sys.executable, str(JOBS), kind, str(path)], name=kind)


def _result(proc: subprocess.Popen, timeout: float) -> dict:
    proc.wait(timeout)
    log = proc.log_path.read_text(errors="replace")
    lines = [line for line in log.splitlines() if line.startswith("result ")]
    assert proc.returncode == 0 and lines, f"{proc.name} failed (exit {proc.returncode}):\n{log[-3000:]}"
    return json.loads(lines[-1][len("result "):])


def test_generation_and_training_across_three_sites_equal_one_process(llama_dir, tmp_path):
    input_ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(11))
    with Testbed(6, "three_sites", workdir=tmp_path / "tb") as tb:
        prefix = tb.prefix
        h = {host.name: host for host in tb.hosts}
        assert tb.rate(h["h3"], h["h1"]) == 100e6 and tb.rate(h["h2"], h["h4"]) == 8e6
        with LocalSwarm(tmp_path / "swarm", update_period=2.0, train=True) as swarm:
            swarm.start_dht(host=h["h0"])
            assert all(m.startswith(f"/ip4/{h['h0'].address}/") for m in swarm.initial_peers)
            procs = [swarm.start_peer(llama_dir, block_indices=span, wait=False, name=f"stage-{name}",
                                      host=h[name]) for name, span in SPANS.items()]
            for proc in procs:
                swarm.wait_ready(proc)
            common = {"model_dir": str(llama_dir), "initial_peers": swarm.initial_peers, "peers": len(SPANS)}
            gen = _job(tb, h["h3"], "generate", {**common, "address": h["h3"].address,
                                                 "input_ids": input_ids.tolist(), "max_new_tokens": 16},
                       tmp_path / "generate.json")
            train = _job(tb, h["h5"], "train", {**common, "address": h["h5"].address, "optim": OPTIM,
                                                "identity_path": str(swarm.trainer_identity()), "text": TEXT,
                                                "run_id": "wan", **TRAIN}, tmp_path / "train.json")
            generated, trained = _result(gen, 120), _result(train, 120)
            for src, dst in (("h3", "h1"), ("h2", "h4"), ("h4", "h3"), ("h5", "h1"), ("h4", "h5")):
                assert tb.sent_bytes(h[src], h[dst]) > 20_000, (src, dst)  # the hops went through the shapers
            pids = sorted({pid for ns in tb.state.namespaces for pid in pids_in_netns(ns)})
            assert len(pids) >= 8  # 4 swarm processes and their p2p daemons at least
    assert nothing_left(leftovers(prefix, pids)), leftovers(prefix, pids)

    expected = LocalModel.from_dir(llama_dir).generate_greedy(input_ids, 16)
    assert generated["tokens"] == expected.tolist()

    reference = LocalTrainer(llama_dir, OptimConfig(**OPTIM), TRAIN["accumulation"], stages=[(0, 3), (3, 6), (6, 8)])
    data = TokenBatches(encode_bytes(TEXT), seq_len=TRAIN["seq_len"], micro_batch=TRAIN["micro_batch"],
                        seed=TRAIN["seed"])
    local = [reference.train_step([data.next_micro() for _ in range(TRAIN["accumulation"])])
             for _ in range(TRAIN["steps"])]
    # fp32 on both sides, one micro-batch in flight: the same sums in the same order, so equal up to float noise
    assert trained["losses"] == pytest.approx(local, abs=1e-6)
    probe = data.next_micro()
    assert trained["probe"] == probe.tolist()
    served = torch.tensor(trained["logits"])  # the peers serve the weights they trained
    assert (served - reference.logits(probe).detach()).abs().max() <= 1e-6
