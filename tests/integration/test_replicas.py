"""Replicas of a stage share its micro-batches, average their parameters every H steps, and a late one catches up
and joins the running training run."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig
from peers.trainer.swarm_trainer import SwarmTrainer
from peers.training import OptimConfig, TokenBatches, encode_bytes
from peers.training.state import read_state_info

TEXT = "Replicas of one stage train on different micro-batches and then agree. " * 40


def _weights(workdir, name: str, run_id: str) -> dict[str, torch.Tensor]:
    return load_file(str(workdir / f"ckpt-{name}" / run_id / "blocks-4-8" / "weights.safetensors"))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_replicas_average_and_a_late_replica_catches_up_and_joins(fresh_swarm, llama_dir):
    swarm = fresh_swarm
    ckpt = {name: ["--checkpoint_dir", str(swarm.workdir / f"ckpt-{name}")] for name in ("a", "b", "c")}
    first = swarm.start_peer(llama_dir, block_indices="0:4", wait=False, name="first")
    a = swarm.start_peer(llama_dir, block_indices="4:8", wait=False, name="a", extra=ckpt["a"])
    b = swarm.start_peer(llama_dir, block_indices="4:8", wait=False, name="b", extra=ckpt["b"])
    for proc in (first, a, b):
        swarm.wait_ready(proc)
    config = ClientConfig(swarm=swarm.trainer_config(), request_timeout=30)
    run_id = "replicas"
    with SwarmClient(llama_dir, config=config) as client:
        client.wait_for_records(3)
        trainer = SwarmTrainer(client, OptimConfig(lr=5e-3), 4, in_flight=4, run_id=run_id, checkpoint_every=1,
                               average_every=2, rechoose_every=0.1)
        trainer.start()
        assert [len(group) for group in trainer.replicas] == [1, 2] and trainer.shares[1] == [2, 2]
        data = TokenBatches(encode_bytes(TEXT), seq_len=16, micro_batch=2, seed=0)
        losses = []
        for step in range(1, 5):
            result = trainer.train_step([data.next_micro() for _ in range(4)])
            losses.append(result.loss)
            assert result.stage_steps == [step, step]  # both replicas stepped on their halves
            same = _same(_weights(swarm.workdir, "a", run_id), _weights(swarm.workdir, "b", run_id))
            assert same == (step % 2 == 0), f"after step {step} the replicas should {'' if step % 2 else 'not '}agree"
        assert losses[-1] < losses[0]

        late = swarm.start_peer(llama_dir, block_indices="4:8", name="c", extra=ckpt["c"])
        assert "Fetched the current parameters of blocks 4:8" in late.log()
        hidden = torch.randn(1, 5, 64)
        outputs = [client.loop.run(client.call_forward(p.peer_id, hidden, 4, 8)) for p in (a, b, late)]
        assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])

        # the running trainer finds the joiner at its next step; it starts counting at the run's step 4, so the
        # three replicas' averaging rounds line up: after step 6 all three hold the same weights
        client.wait_for_records(4)
        result = trainer.train_step([data.next_micro() for _ in range(4)])
        assert [len(group) for group in trainer.replicas] == [1, 3], "the late replica should have joined the run"
        assert late.peer_id in [r.peer_id for r in trainer.replicas[1]] and sum(trainer.shares[1]) == 4
        assert result.stage_steps == [5, 5] and "joined at step 4" in late.log()
        assert read_state_info(swarm.workdir / "ckpt-c" / run_id / "blocks-4-8")["step"] == 5
        trainer.train_step([data.next_micro() for _ in range(4)])
        weights = [_weights(swarm.workdir, name, run_id) for name in ("a", "b", "c")]
        assert _same(weights[0], weights[1]) and _same(weights[0], weights[2]), "an averaging round should include it"


def test_a_joiner_busy_with_another_trainer_is_skipped_and_both_runs_go_on(fresh_swarm, llama_dir, caplog):
    """Peers that start serving the pipeline's spans but train another trainer's run refuse to join: the first
    trainer carries on with its own stages, and the other run is not disturbed."""
    swarm = fresh_swarm
    first = [swarm.start_peer(llama_dir, block_indices=s, wait=False, name=f"one-{s}") for s in ("0:4", "4:8")]
    for proc in first:
        swarm.wait_ready(proc)
    data = TokenBatches(encode_bytes(TEXT), seq_len=16, micro_batch=2, seed=0)
    with SwarmClient(llama_dir, config=ClientConfig(swarm=swarm.trainer_config())) as client:
        client.wait_for_records(2)
        trainer = SwarmTrainer(client, OptimConfig(lr=5e-3), 2, run_id="one", rechoose_every=0.1)
        assert trainer.train_step([data.next_micro() for _ in range(2)]).stage_steps == [1, 1]

        both = f"{swarm.trainer_id()},{swarm.trainer_id('other')}"  # they allow both trainers: busy is why they refuse
        second = [swarm.start_peer(llama_dir, block_indices=s, wait=False, name=f"two-{s}", trainers=both)
                  for s in ("0:4", "4:8")]
        for proc in second:
            swarm.wait_ready(proc)
        other = ClientConfig(swarm=swarm.trainer_config("other"), allowed_peers=tuple(p.peer_id for p in second))
        with SwarmClient(llama_dir, config=other) as other_client:
            other_client.wait_for_records(2)
            other_trainer = SwarmTrainer(other_client, OptimConfig(lr=5e-3), 2, run_id="two")
            assert other_trainer.train_step([data.next_micro() for _ in range(2)]).stage_steps == [1, 1]

            client.wait_for_records(4)
            for step in (2, 3):  # the joiners refuse (another trainer's run): the first run keeps its stages
                result = trainer.train_step([data.next_micro() for _ in range(2)])
                assert result.stage_steps == [step, step]
                assert [[r.peer_id for r in group] for group in trainer.replicas] == [[p.peer_id] for p in first]
            assert caplog.text.count("a joining peer refused the run") == 1  # tried once, then not again
            assert other_trainer.train_step([data.next_micro() for _ in range(2)]).stage_steps == [2, 2]
