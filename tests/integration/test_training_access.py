"""Issue 15 on real processes: who may train a peer (finding 1), and trained weights never lost to older ones
(finding 12)."""

from __future__ import annotations

import time

import pytest
import torch

from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig, SwarmConfig
from peers.trainer.swarm_trainer import SwarmTrainer
from peers.training import OptimConfig, TokenBatches, encode_bytes
from peers.training.state import read_state_info
from peers.wire.errors import RequestError
from peers.wire.messages import ParamsFetch, ParamsPush, TrainApply, TrainBackward, TrainForward, TrainOpen
from privacy.peer_ids import peer_id_of
from swarm.records import PeerState

OPTIM = OptimConfig(lr=3e-3, warmup_steps=1, clip_norm=1.0)
TEXT = "Only the trainers a peer's operator allows may change what it serves. " * 40
ATTACK = {"lr": 1e30, "clip_norm": 0.0}  # the config: one step and every client computes NaN


def _batches() -> TokenBatches:
    return TokenBatches(encode_bytes(TEXT), seq_len=16, micro_batch=2, seed=0)


def _wait_online(client: SwarmClient, peer_id: str, timeout: float = 60.0) -> None:
    """Wait until ``peer_id``'s ONLINE record is in the DHT (a busy machine may take a few announcements)."""
    deadline = time.monotonic() + timeout
    while not any(r.peer_id == peer_id and r.state == PeerState.ONLINE for r in client.records()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"peer ...{peer_id[-6:]} is not online in the DHT after {timeout:.0f} s")
        time.sleep(0.5)


def test_finding_01_stranger_cannot_train(fresh_swarm, llama_dir):
    """Peers train only for the trainers their operator allowed; a stranger's training calls are refused with what
    the operator must pass, its parameter pushes too, and what every client computes is unchanged."""
    swarm = fresh_swarm
    stage0 = swarm.start_peer(llama_dir, block_indices="0:4", wait=False, name="stage0")  # --trainers TRAINER_ID
    stage1 = swarm.start_peer(llama_dir, block_indices="4:8", wait=False, name="stage1")
    closed = swarm.start_peer(llama_dir, block_indices="4:8", wait=False, name="closed", trainers="")  # no flag
    for proc in (stage0, stage1, closed):
        swarm.wait_ready(proc)
    hidden = torch.randn(2, 6, 64)
    stranger_config = ClientConfig(swarm=SwarmConfig(initial_peers=tuple(swarm.initial_peers)), request_timeout=20)
    with SwarmClient(llama_dir, config=stranger_config) as stranger:
        stranger.wait_for_records(3)
        me = peer_id_of(stranger.identity.public_bytes)
        served = stranger.loop.run(stranger.call_forward(stage1.peer_id, hidden, 4, 8))
        stream = stranger.loop.run(stranger.peer_stream(stage1.peer_id))

        def call(message, tensor=None):
            return stranger.loop.run(stream.call(message, tensor, 10))

        with pytest.raises(RequestError, match=f"peer {me} may not train this peer .*add your peer id to --trainers"):
            call(TrainOpen(run_id="attack", start=4, end=8, optim=ATTACK, accumulation=1, explicit_apply=True))
        for message, tensor in ((TrainForward(run_id="attack", micro_id="m"), hidden),
                                (TrainBackward(run_id="attack", micro_id="m"), torch.zeros_like(hidden)),
                                (TrainApply(run_id="attack", micro_batches=1), None)):
            with pytest.raises(RequestError, match="may not train this peer"):
                call(message, tensor)
        reply, flat = call(ParamsFetch(start=4, end=8))  # the current parameters stay readable to the admitted
        assert reply.step == 0 and flat.ndim == 1
        with pytest.raises(RequestError, match="averages no run"):  # pushes count only from a run's replicas
            call(ParamsPush(run_id="attack", round=0), torch.full_like(flat, float("nan")))
        closed_stream = stranger.loop.run(stranger.peer_stream(closed.peer_id))
        with pytest.raises(RequestError, match=f"does not train: .*--trainers {me} \\(your peer id\\)"):
            stranger.loop.run(closed_stream.call(TrainOpen(run_id="x", start=4, end=8, optim=OPTIM.to_dict(),
                                                           accumulation=1), None, 10))
        assert torch.equal(stranger.loop.run(stranger.call_forward(stage1.peer_id, hidden, 4, 8)), served)

    trainer_config = ClientConfig(swarm=swarm.trainer_config(), request_timeout=20,
                                  allowed_peers=(stage0.peer_id, stage1.peer_id))
    with SwarmClient(llama_dir, config=trainer_config) as client:
        client.wait_for_records(2)
        stream = client.loop.run(client.peer_stream(stage1.peer_id))
        with pytest.raises(RequestError, match="lr must be > 0 and at most 1"):  # an allowed trainer is bounded too
            client.loop.run(stream.call(TrainOpen(run_id="wild", start=4, end=8, optim=ATTACK, accumulation=1),
                                        None, 10))
        trainer = SwarmTrainer(client, OPTIM, 2, run_id="allowed")
        data = _batches()
        assert trainer.train_step([data.next_micro() for _ in range(2)]).stage_steps == [1, 1]
        after = client.loop.run(client.call_forward(stage1.peer_id, hidden, 4, 8))
        assert torch.isfinite(after).all() and not torch.equal(after, served)  # its operator chose this trainer


def test_finding_01_a_step_that_would_serve_nan_is_rolled_back(fresh_swarm, llama_dir):
    """Defence in depth against an allowed but buggy trainer: float16 AdamW turns a zero gradient into NaN (its eps
    underflows); the peer rolls that step back and refuses it, and keeps serving finite, unchanged outputs."""
    swarm = fresh_swarm
    peer = swarm.start_peer(llama_dir, block_indices="0:8", name="half", extra=["--torch_dtype", "float16"])
    hidden = torch.randn(2, 6, 64, dtype=torch.float16)
    with SwarmClient(llama_dir, config=ClientConfig(swarm=swarm.trainer_config(), torch_dtype="float16",
                                                    request_timeout=20)) as client:
        client.wait_for_records(1)
        stream = client.loop.run(client.peer_stream(peer.peer_id))

        def call(message, tensor=None):
            return client.loop.run(stream.call(message, tensor, 20))

        before = client.loop.run(client.call_forward(peer.peer_id, hidden, 0, 8))
        call(TrainOpen(run_id="half", start=0, end=8, optim=OPTIM.to_dict(), accumulation=1, explicit_apply=True))
        _, out = call(TrainForward(run_id="half", micro_id="zero"), hidden)
        call(TrainBackward(run_id="half", micro_id="zero"), torch.zeros_like(out))
        with pytest.raises(RequestError, match="NaN or infinite; it was rolled back"):
            call(TrainApply(run_id="half", micro_batches=1))
        after = client.loop.run(client.call_forward(peer.peer_id, hidden, 0, 8))
        assert torch.isfinite(after).all() and torch.equal(after, before)


def test_finding_12_a_restarted_peer_keeps_newer_weights_and_the_replica_behind_catches_up(fresh_swarm, llama_dir):
    """A trained 4:8 peer (step 3) restarts while an untrained 4:8 replica (step 0) serves: it keeps its own
    checkpoint and says so, naming both steps; when the trainer opens the run, the replica behind catches up."""
    swarm = fresh_swarm
    checkpoints = swarm.workdir / "ckpt"
    flags = ["--checkpoint_dir", str(checkpoints), "--identity_path", str(swarm.workdir / "trained.id")]
    stage0 = swarm.start_peer(llama_dir, block_indices="0:4", name="stage0", wait=False)
    trained = swarm.start_peer(llama_dir, block_indices="4:8", name="trained", extra=flags, wait=False)
    for proc in (stage0, trained):
        swarm.wait_ready(proc)
    config = ClientConfig(swarm=swarm.trainer_config(), request_timeout=30)
    hidden, data = torch.randn(1, 5, 64), _batches()
    with SwarmClient(llama_dir, config=config) as client:
        client.wait_for_records(2)
        trainer = SwarmTrainer(client, OPTIM, 4, run_id="ahead", checkpoint_every=1)
        for _ in range(3):
            trainer.train_step([data.next_micro() for _ in range(4)])
        weights = client.loop.run(client.call_forward(trained.peer_id, hidden, 4, 8))
    trained.stop()
    untrained = swarm.start_peer(llama_dir, block_indices="4:8", name="untrained")  # nobody to fetch from: step 0
    with SwarmClient(llama_dir, config=config) as client:
        _wait_online(client, untrained.peer_id)  # the restarted peer looks for replicas once, as it starts
        again = swarm.start_peer(llama_dir, block_indices="4:8", name="trained-again", extra=flags)
        log = again.log()
        assert "Resumed blocks 4:8 of run 'ahead'" in log
        assert f"kept our checkpoint of run 'ahead' at step 3; replica ...{untrained.peer_id[-6:]} serves step 0, " \
            "older" in log and "Fetched the current parameters" not in log
        _wait_online(client, again.peer_id)
        assert torch.equal(client.loop.run(client.call_forward(again.peer_id, hidden, 4, 8)), weights)
        assert not torch.equal(client.loop.run(client.call_forward(untrained.peer_id, hidden, 4, 8)), weights)
        trainer = SwarmTrainer(client, OPTIM, 4, run_id="ahead", checkpoint_every=1)
        trainer.start()
        assert sorted(r.peer_id for r in trainer.replicas[1]) == sorted([again.peer_id, untrained.peer_id])
        assert trainer.run_step == 3 and "caught up from replica" in untrained.log()
        assert torch.equal(client.loop.run(client.call_forward(untrained.peer_id, hidden, 4, 8)), weights)
        assert trainer.train_step([data.next_micro() for _ in range(4)]).stage_steps == [4, 4]
    assert read_state_info(checkpoints / "ahead" / "blocks-4-8")["step"] == 4
