"""Training through the swarm on real processes: equivalence with one process, bad gradients, a vanished trainer."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch
from safetensors.torch import load_file
from torch.nn.utils import vector_to_parameters

from peers.cli.launch import LocalSwarm
from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig, SwarmConfig
from peers.trainer.swarm_trainer import SwarmTrainer
from peers.training import LocalTrainer, OptimConfig, TokenBatches, encode_bytes
from peers.wire.errors import RequestError
from peers.wire.messages import ParamsFetch, TrainApply, TrainBackward, TrainForward, TrainOpen

OPTIM = OptimConfig(lr=3e-3, warmup_steps=1, schedule="cosine", total_steps=6, clip_norm=1.0, weight_decay=0.01)
TEXT = "A swarm of ordinary computers trains one model together, block by block. " * 40


def _start(workdir, llama_dir) -> LocalSwarm:
    swarm = LocalSwarm(workdir, update_period=2.0, train=True)  # the peers allow the swarm's trainer
    swarm.start_dht()
    procs = [swarm.start_peer(llama_dir, block_indices=span, wait=False, name=f"stage{i}",
                              extra=["--checkpoint_dir", str(workdir / f"ckpt{i}")])
             for i, span in enumerate(("0:4", "4:8"))]
    for proc in procs:
        swarm.wait_ready(proc)
    return swarm


@pytest.fixture(scope="module")
def train_swarm(llama_dir, tmp_path_factory) -> Iterator[LocalSwarm]:
    """Two stage peers shared by the module's tests (a reference takes the weights they serve: ``_reference``)."""
    with _start(tmp_path_factory.mktemp("train_swarm"), llama_dir) as swarm:
        yield swarm


def _client(swarm: LocalSwarm, model_dir, trainer: bool = True) -> SwarmClient:
    """The swarm's trainer (the identity its peers allow), or with ``trainer=False`` a client with a fresh one."""
    config = swarm.trainer_config() if trainer else SwarmConfig(initial_peers=tuple(swarm.initial_peers))
    client = SwarmClient(model_dir, config=ClientConfig(swarm=config, request_timeout=20))
    client.wait_for_records(2)
    return client


def _batches(seed: int) -> TokenBatches:
    return TokenBatches(encode_bytes(TEXT), seq_len=16, micro_batch=2, seed=seed)


def _reference(client: SwarmClient, llama_dir, accumulation: int) -> LocalTrainer:
    """One process with the model's embedding and head and the blocks the peers serve now (earlier tests of the
    module may have trained them): exactly their parameters, fetched from them."""
    reference = LocalTrainer(llama_dir, OPTIM, accumulation, stages=[(0, 4), (4, 8)])
    for block, record in zip(reference.blocks, sorted(client.records(), key=lambda r: r.start), strict=True):
        stream = client.loop.run(client.peer_stream(record.peer_id))
        _, flat = client.loop.run(stream.call(ParamsFetch(start=record.start, end=record.end), None, 10))
        with torch.no_grad():
            vector_to_parameters(flat, block.parameters())
    return reference


@pytest.mark.parametrize("in_flight, recompute", [(1, False), (3, True)])
def test_swarm_training_equals_one_process(train_swarm, llama_dir, in_flight, recompute):
    """Same parameters and losses as the same steps in one process (fp32), through encrypted streams."""
    steps, accumulation = 3, 3
    with _client(train_swarm, llama_dir) as client:
        reference = _reference(client, llama_dir, accumulation)
        trainer = SwarmTrainer(client, OPTIM, accumulation, in_flight=in_flight, recompute=recompute,
                               checkpoint_every=1, run_id=f"equivalence-{in_flight}-{recompute}")
        trainer.start()
        data_swarm, data_local = _batches(1), _batches(1)
        for _ in range(steps):
            swarm_loss = trainer.train_step([data_swarm.next_micro() for _ in range(accumulation)]).loss
            local_loss = reference.train_step([data_local.next_micro() for _ in range(accumulation)])
            assert swarm_loss == pytest.approx(local_loss, abs=1e-6)
        ids = data_local.next_micro()
        expected = reference.logits(ids).detach()
        served = client.forward(ids)  # the peers serve the weights they trained
        tolerance = 0.0 if in_flight == 1 else 1e-5  # in-flight micro-batches may sum their grads in another order
        assert (served - expected).abs().max() <= tolerance + 1e-6
        for i, (start, end) in enumerate([(0, 4), (4, 8)]):
            saved = load_file(str(train_swarm.workdir / f"ckpt{i}" / trainer.run_id / f"blocks-{start}-{end}" /
                                  "weights.safetensors"))
            local = dict(reference.blocks[i].named_parameters())
            assert set(saved) == set(local)
            assert max((saved[k] - local[k].detach()).abs().max().item() for k in saved) <= tolerance + 1e-6
        for name, param in client.embedding.named_parameters():
            assert (param - dict(reference.embedding.named_parameters())[name]).abs().max() <= tolerance + 1e-6


def _stage_stream(client: SwarmClient, trainer: SwarmTrainer, index: int):
    return client.loop.run(client.peer_stream(trainer.stages[index].peer_id))


def test_bad_gradients_are_refused_and_nothing_is_applied(train_swarm, llama_dir):
    with _client(train_swarm, llama_dir) as client:
        trainer = SwarmTrainer(client, OPTIM, 1, run_id="bad-grads")
        trainer.start()
        stream = _stage_stream(client, trainer, 1)
        hidden = torch.randn(2, 6, 64)

        async def forward(micro_id: str) -> torch.Tensor:
            _, out = await stream.call(TrainForward(run_id="bad-grads", micro_id=micro_id), hidden, 10)
            return out

        async def backward(micro_id: str, grad: torch.Tensor):
            return await stream.call(TrainBackward(run_id="bad-grads", micro_id=micro_id), grad, 10)

        async def apply(count: int):
            return await stream.call(TrainApply(run_id="bad-grads", micro_batches=count), None, 10)

        before = client.loop.run(forward("probe"))
        client.loop.run(backward("probe", torch.zeros_like(before)))
        assert client.loop.run(apply(1))[0].step == 1  # a zero grad: only AdamW's weight decay moves the weights
        for micro_id, grad, message in (
            ("shape", torch.zeros(2, 5, 64), "has shape"),
            ("nan", torch.full((2, 6, 64), float("nan")), "NaN or infinite"),
            ("inf", torch.full((2, 6, 64), float("inf")), "NaN or infinite"),
        ):
            client.loop.run(forward(micro_id))
            with pytest.raises(RequestError, match=message):
                client.loop.run(backward(micro_id, grad))
            with pytest.raises(RequestError, match="not pending"):  # the refused micro-batch was dropped
                client.loop.run(backward(micro_id, torch.zeros(2, 6, 64)))
        with pytest.raises(RequestError, match="not pending"):
            client.loop.run(backward("never-forwarded", torch.zeros(2, 6, 64)))
        with pytest.raises(RequestError, match="holds 0 micro-batch"):  # a step missing micro-batches is refused
            client.loop.run(apply(1))
        after = client.loop.run(forward("after"))
        reference = client.loop.run(forward("again"))
        assert torch.equal(after, reference)  # refusals stepped nothing
        client.loop.run(backward("after", torch.ones_like(after) * 1e-3))
        client.loop.run(forward("lost"))
        client.loop.run(backward("lost", torch.ones_like(after) * 1e-3))
        with pytest.raises(RequestError, match="holds 2 micro-batch"):  # the trainer expected 3: nothing applied
            client.loop.run(apply(3))
        assert torch.equal(client.loop.run(forward("unchanged")), reference)
        client.loop.run(backward("unchanged", torch.ones_like(after) * 1e-3))
        assert client.loop.run(apply(1))[0].step == 2  # a good micro-batch still trains
        with pytest.raises(RequestError, match="not open on this stream"):
            client.loop.run(stream.call(TrainForward(run_id="other-run", micro_id="x"), hidden, 10))


def test_a_vanished_trainer_leaves_no_half_applied_update(train_swarm, llama_dir):
    ids = torch.arange(12)[None]
    with _client(train_swarm, llama_dir, trainer=False) as observer:
        before = observer.forward(ids)
        with _client(train_swarm, llama_dir) as client:
            trainer = SwarmTrainer(client, OPTIM, 4, run_id="vanishing")
            trainer.start()
            data = _batches(2)

            async def half_a_step():  # 2 of the 4 micro-batches of a step, then the trainer leaves
                run = trainer._step_run([], ahead=False)
                await asyncio.gather(*(trainer._micro_batch(run, data.next_micro(), i) for i in range(2)))

            client.loop.run(half_a_step())
        after = observer.forward(ids)
        assert torch.equal(before, after)
        # the run can be taken over by a new trainer, whose full steps do apply
        with _client(train_swarm, llama_dir) as client:
            trainer = SwarmTrainer(client, OPTIM, 4, run_id="vanishing")
            result = trainer.train_step([data.next_micro() for _ in range(4)])
            assert result.stage_steps == [1, 1]
        assert not torch.equal(before, observer.forward(ids))


def test_train_open_refusals(train_swarm, llama_dir):
    with _client(train_swarm, llama_dir) as client:
        peer_id = next(r.peer_id for r in client.records() if r.start == 0)
        stream = client.loop.run(client.peer_stream(peer_id))
        good = dict(run_id="x", start=0, end=4, optim=OPTIM.to_dict(), accumulation=2)
        for change, message in (({"end": 3}, "whole span"), ({"optim": {"lr": "fast"}}, "bad optimizer config"),
                                ({"accumulation": 0}, "accumulation must be")):
            with pytest.raises(RequestError, match=message):
                client.loop.run(stream.call(TrainOpen(**{**good, **change}), None, 10))
        reply, _ = client.loop.run(stream.call(TrainOpen(**good), None, 10))
        assert reply.step == 0


def test_a_stage_peer_that_dies_mid_run_costs_a_retry_not_a_step(fresh_swarm, llama_dir):
    """Two replicas of 4:8; one is killed: the step is retried on the other and every step is applied once."""
    swarm = fresh_swarm
    first = swarm.start_peer(llama_dir, block_indices="0:4", wait=False, name="first")
    a = swarm.start_peer(llama_dir, block_indices="4:8", wait=False, name="a")
    b = swarm.start_peer(llama_dir, block_indices="4:8", wait=False, name="b")
    for proc in (first, a, b):
        swarm.wait_ready(proc)
    # the killed peer's stream breaks at once (its process is gone): the timeout only has to outlast a slow step
    # on a loaded machine (4 s did not always, and blamed a live peer)
    config = ClientConfig(swarm=swarm.trainer_config(), request_timeout=20)
    with SwarmClient(llama_dir, config=config) as client:
        client.wait_for_records(3)
        trainer = SwarmTrainer(client, OPTIM, 2, in_flight=2, run_id="survivor")
        trainer.start()
        assert len(trainer.replicas[1]) == 2
        data = _batches(3)
        assert trainer.train_step([data.next_micro() for _ in range(2)]).stage_steps == [1, 1]
        a.kill()
        result = trainer.train_step([data.next_micro() for _ in range(2)])
        assert [r.peer_id for r in trainer.replicas[1]] == [b.peer_id]
        assert result.stage_steps == [2, 2]  # stage 0 applied the retried step once; b took both micro-batches
        assert trainer.train_step([data.next_micro() for _ in range(2)]).stage_steps == [3, 3]


def test_a_restarted_stage_peer_resumes_from_its_checkpoint(fresh_swarm, llama_dir):
    """Weights and AdamW state come back after a restart: the run continues at the peer's saved step. The peer
    saves every 2 steps and, when it is stopped, its last step too: step 3 is not lost."""
    swarm = fresh_swarm
    identity = swarm.workdir / "stage1.id"
    flags = ["--checkpoint_dir", str(swarm.workdir / "ckpt"), "--identity_path", str(identity)]
    stage0 = swarm.start_peer(llama_dir, block_indices="0:4", name="stage0", wait=False)
    stage1 = swarm.start_peer(llama_dir, block_indices="4:8", name="stage1", extra=flags, wait=False)
    for proc in (stage0, stage1):
        swarm.wait_ready(proc)
    config = ClientConfig(swarm=swarm.trainer_config(), request_timeout=20)
    hidden = torch.randn(1, 5, 64)
    with SwarmClient(llama_dir, config=config) as client:
        client.wait_for_records(2)
        trainer = SwarmTrainer(client, OPTIM, 2, run_id="restart", checkpoint_every=2)
        data = _batches(5)
        for _ in range(3):
            trainer.train_step([data.next_micro() for _ in range(2)])
        trained = client.loop.run(client.call_forward(stage1.peer_id, hidden, 4, 8))
    stage1.stop()
    assert "step 3 saved to" in stage1.log()
    again = swarm.start_peer(llama_dir, block_indices="4:8", name="stage1-again", extra=flags)
    assert again.peer_id == stage1.peer_id  # same identity file, same peer id
    assert "Resumed blocks 4:8 of run 'restart'" in again.log()
    with SwarmClient(llama_dir, config=config) as client:
        client.wait_for_records(2)
        assert torch.equal(client.loop.run(client.call_forward(again.peer_id, hidden, 4, 8)), trained)  # at once
        stream = client.loop.run(client.peer_stream(again.peer_id))
        reply, _ = client.loop.run(stream.call(TrainOpen(run_id="restart", start=4, end=8, optim=OPTIM.to_dict(),
                                                         accumulation=2), None, 10))
        assert reply.step == 3
        assert torch.equal(client.loop.run(client.call_forward(again.peer_id, hidden, 4, 8)), trained)
