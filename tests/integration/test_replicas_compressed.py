"""Replicas of a stage average compressed deltas (top-k + int8, error feedback) and still hold the same weights."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig
from peers.trainer.swarm_trainer import SwarmTrainer
from peers.training import OptimConfig, TokenBatches, encode_bytes

TEXT = "Replicas of one stage send what changed, a tenth of it, and still agree. " * 40
RUN = "compressed-replicas"


def _weights(workdir, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(workdir / f"ckpt-{name}" / RUN / "blocks-4-8" / "weights.safetensors"))


def test_replicas_averaging_compressed_deltas_agree_after_every_round(fresh_swarm, llama_dir):
    swarm = fresh_swarm
    first = swarm.start_peer(llama_dir, block_indices="0:4", wait=False, name="first")
    a, b = (swarm.start_peer(llama_dir, block_indices="4:8", wait=False, name=name,
                             extra=["--checkpoint_dir", str(swarm.workdir / f"ckpt-{name}")]) for name in ("a", "b"))
    for proc in (first, a, b):
        swarm.wait_ready(proc)
    with SwarmClient(llama_dir, config=ClientConfig(swarm=swarm.trainer_config(), request_timeout=30)) as client:
        client.wait_for_records(3)
        trainer = SwarmTrainer(client, OptimConfig(lr=5e-3), 4, in_flight=4, run_id=RUN, checkpoint_every=1,
                               average_every=1, rechoose_every=0.1, compression="topk:0.1/int8")
        trainer.start()
        assert [len(group) for group in trainer.replicas] == [1, 2]
        data = TokenBatches(encode_bytes(TEXT), seq_len=16, micro_batch=2, seed=0)
        before = None
        for step in range(1, 4):
            assert trainer.train_step([data.next_micro() for _ in range(4)]).stage_steps == [step, step]
            weights = [_weights(swarm.workdir, name) for name in ("a", "b")]
            assert weights[0].keys() == weights[1].keys()
            assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0]), f"step {step}: replicas differ"
            assert before is None or any(not torch.equal(before[k], weights[0][k]) for k in before)
            before = weights[0]
    for proc in (a, b):  # every round's push a delta: the anchors agreed throughout
        log = proc.log()
        assert log.count("(our delta in topk:0.1/int8)") == 3, log[-3000:]
        assert "in full" not in log
