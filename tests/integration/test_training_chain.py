"""Training as a chain (issue 12) on real processes: stages hand activations and gradients to each other; the
trainer's link carries the first stage's input and the last stage's output only. Losses equal one process in both
topologies; a push from a peer the run did not name is refused; a stage killed mid-run costs a retry."""

from __future__ import annotations

import shutil

import pytest
import torch

from peers.cli.launch import LocalSwarm, SwarmProcess
from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig, SwarmConfig
from peers.trainer import chain
from peers.trainer.swarm_trainer import SwarmTrainer
from peers.training import LocalTrainer, OptimConfig, TokenBatches, encode_bytes
from peers.wire.errors import RequestError
from peers.wire.messages import TrainPush

OPTIM = OptimConfig(lr=3e-3, warmup_steps=1, schedule="cosine", total_steps=6, clip_norm=1.0, weight_decay=0.01)
TEXT = "Each stage hands its output to the next one; the trainer sees the ends of the chain only. " * 40
STEPS, ACCUMULATION = 3, 3


def _peers(swarm: LocalSwarm, llama_dir, spans: dict[str, str], copy_dir=None) -> dict[str, SwarmProcess]:
    """Peers ``spans`` of the model, started together (with ``copy_dir``, the same spans of that model too)."""
    procs = {name: swarm.start_peer(llama_dir, block_indices=span, wait=False, name=name)
             for name, span in spans.items()}
    if copy_dir is not None:
        procs.update({f"{name}-copy": swarm.start_peer(copy_dir, block_indices=span, wait=False, name=f"{name}-copy")
                      for name, span in spans.items()})
    for proc in procs.values():
        swarm.wait_ready(proc)
    return procs


def _client(swarm: LocalSwarm, llama_dir, peers: int, timeout: float = 20) -> SwarmClient:
    client = SwarmClient(llama_dir, config=ClientConfig(swarm=swarm.trainer_config(), request_timeout=timeout))
    client.wait_for_records(peers)
    return client


def _batches(seed: int = 1) -> TokenBatches:
    return TokenBatches(encode_bytes(TEXT), seq_len=16, micro_batch=2, seed=seed)


def _hidden_bytes(micro: torch.Tensor) -> int:
    return micro.numel() * 64 * 4  # [b, T] tokens x hidden 64 x fp32


@pytest.fixture(scope="module")
def three_stage_swarm(train_stages) -> tuple[LocalSwarm, dict[str, SwarmProcess]]:
    """Three stage peers (0:3, 3:6, 6:8) shared by the module's tests that kill none, and by other modules
    (``conftest.py``): a reference takes the weights they serve now."""
    return train_stages


@pytest.mark.parametrize("topology, in_flight, recompute", [("chain", 3, False), ("chain", 2, True),
                                                            ("star", 1, False)])
def test_three_stages_train_like_one_process(three_stage_swarm, served_weights, llama_dir, topology, in_flight,
                                             recompute):
    """Losses equal one process; the trainer sends 2 hidden states per micro-batch in a chain, 2 per stage in a
    star; a middle stage's stream from the trainer carries metadata only in a chain."""
    swarm, procs = three_stage_swarm
    with _client(swarm, llama_dir, 3) as client:
        # one process with the model's embedding and head and exactly the blocks the stages serve now
        reference = LocalTrainer(llama_dir, OPTIM, ACCUMULATION, stages=[(0, 3), (3, 6), (6, 8)])
        served_weights(client, reference, procs)
        trainer = SwarmTrainer(client, OPTIM, ACCUMULATION, in_flight=in_flight, recompute=recompute,
                               run_id=f"three-{topology}-{recompute}", topology=topology)
        trainer.start()
        middle = client.loop.run(client.peer_stream(trainer.stages[1].peer_id))
        before = middle.bytes_sent + middle.bytes_received
        data_swarm, data_local = _batches(), _batches()
        micro_bytes = 0
        for step in range(1, STEPS + 1):
            micro = [data_swarm.next_micro() for _ in range(ACCUMULATION)]
            micro_bytes += sum(_hidden_bytes(m) for m in micro)
            result = trainer.train_step(micro)
            local = reference.train_step([data_local.next_micro() for _ in range(ACCUMULATION)])
            assert result.loss == pytest.approx(local, abs=1e-6)
            assert result.stage_steps == [step] * 3
            assert all(busy > 0 for busy in result.stage_busy)
        per_tensor = 2 if topology == "chain" else 2 * 3 + (3 if recompute else 0)
        assert trainer.bytes_sent == per_tensor * micro_bytes
        middle_bytes = middle.bytes_sent + middle.bytes_received - before
        if topology == "chain":
            assert middle_bytes < micro_bytes / 4, "hidden states crossed the trainer's link to a middle stage"
        else:
            assert middle_bytes > 2 * micro_bytes
        ids = data_local.next_micro()
        served = client.forward(ids)  # the peers serve the weights they trained
        assert (served - reference.logits(ids).detach()).abs().max() <= 1e-5


def _replica_losses(swarm: LocalSwarm, model_dir, topology: str) -> list[float]:
    with _client(swarm, model_dir, 3) as client:
        trainer = SwarmTrainer(client, OPTIM, 4, in_flight=2, run_id="replica", topology=topology, average_every=2)
        trainer.start()
        assert [len(group) for group in trainer.replicas] == [1, 2]
        data = _batches(2)
        return [trainer.train_step([data.next_micro() for _ in range(4)]).loss for _ in range(STEPS)]


def test_with_a_replica_chain_and_star_train_alike(tmp_path, llama_dir):
    """Two peers on 4:8: each micro-batch's route takes one of them; the replicas' shares, grad scaling and
    averaging give the same losses as the star (the first step's equals one process).

    The star trains a copy of the model under another name (another model to the swarm, the same weights), on peers
    of its own in the same swarm: both runs start from the initial weights, and all six peers start together."""
    star_dir = shutil.copytree(llama_dir, tmp_path / f"{llama_dir.name}-star")
    with LocalSwarm(tmp_path / "swarm", update_period=1.0, train=True) as swarm:
        swarm.start_dht()
        _peers(swarm, llama_dir, {"first": "0:4", "a": "4:8", "b": "4:8"}, star_dir)
        chained = _replica_losses(swarm, llama_dir, "chain")
        starred = _replica_losses(swarm, star_dir, "star")
    assert chained == pytest.approx(starred, abs=1e-6)
    reference = LocalTrainer(llama_dir, OPTIM, 4, stages=[(0, 4), (4, 8)])
    data = _batches(2)
    assert chained[0] == pytest.approx(reference.train_step([data.next_micro() for _ in range(4)]), abs=1e-6)


def test_a_push_from_a_peer_the_run_did_not_name_is_refused(three_stage_swarm, llama_dir):
    swarm, procs = three_stage_swarm
    with _client(swarm, llama_dir, 3) as client:
        trainer = SwarmTrainer(client, OPTIM, 2, run_id="strangers")
        trainer.start()
        data = _batches(3)
        trainer.train_step([data.next_micro() for _ in range(2)])
        config = ClientConfig(swarm=SwarmConfig(initial_peers=tuple(swarm.initial_peers)), request_timeout=10)
        with SwarmClient(llama_dir, config=config) as stranger:  # an admitted peer, but no stage of the run
            stranger.wait_for_records(3)
            stream = stranger.loop.run(stranger.peer_stream(procs["stage1"].peer_id))
            next_id = f"{trainer.steps_done}.0@{trainer.attempt + 1}"  # what the next step's first micro-batch uses
            for message, why in ((TrainPush(run_id="strangers", micro_id=next_id), "is not a previous stage"),
                                 (TrainPush(run_id="strangers", micro_id=next_id, backward=True),
                                  "is not a next stage"),
                                 (TrainPush(run_id="other", micro_id="0.0"), "is not open on this peer")):
                with pytest.raises(RequestError, match=why):
                    stranger.loop.run(stream.call(message, torch.randn(2, 17, 64), 10))
        result = trainer.train_step([data.next_micro() for _ in range(2)])  # the run goes on
        assert result.stage_steps == [2, 2, 2]
    assert "push refused" in procs["stage1"].log()


def test_a_middle_replica_killed_mid_step_costs_a_retry(fresh_swarm, llama_dir, monkeypatch):
    """3 stages, 3:6 on two peers. One is SIGKILLed between a step's forward and its backward: the step is
    retried on the other (the first stage's push to the dead one names it), and every loss equals one process,
    since the step that failed was applied nowhere."""
    swarm = fresh_swarm
    procs = _peers(swarm, llama_dir, {"stage0": "0:3", "a": "3:6", "b": "3:6", "stage2": "6:8"})
    phases, killed = [], []
    run_phase = chain.run_phase

    async def kill_after_a_forward(trainer, route, messages, tensors, submitted=None):
        replies = await run_phase(trainer, route, messages, tensors, submitted)
        phases.append(route)
        if not killed and procs["a"].peer_id in route:
            killed.append(route)
            procs["a"].kill()
            procs["a"].popen.wait(10)
        return replies

    monkeypatch.setattr(chain, "run_phase", kill_after_a_forward)
    reference = LocalTrainer(llama_dir, OPTIM, 2, stages=[(0, 3), (3, 6), (6, 8)])
    data_swarm, data_local = _batches(4), _batches(4)
    with _client(swarm, llama_dir, 4, timeout=10) as client:
        trainer = SwarmTrainer(client, OPTIM, 2, in_flight=1, run_id="kill", topology="chain")
        trainer.start()
        assert len(trainer.replicas[1]) == 2
        for step in range(1, STEPS + 1):
            result = trainer.train_step([data_swarm.next_micro() for _ in range(2)])
            if step == 1:  # a's first forward phase went through; the backward could not: retried on b alone
                assert killed and [r.peer_id for r in trainer.replicas[1]] == [procs["b"].peer_id]
            local = reference.train_step([data_local.next_micro() for _ in range(2)])
            assert result.loss == pytest.approx(local, abs=1e-6)
            assert result.stage_steps == [step] * 3
        assert trainer.attempt == STEPS + 1  # one retry
