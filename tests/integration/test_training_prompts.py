"""Prompt tuning through the swarm on real processes (star): the trainer's input and deep prompts train, the losses
equal one process bit for bit (fp32), two runs share the peers side by side, the stage peers' blocks stay exactly as
they were, deep prompts of the wrong shape are refused with the peer serving on, and ``swarm train`` resumes prompts."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig
from peers.trainer.state import trainer_checkpoint_path
from peers.trainer.swarm_trainer import SwarmTrainer
from peers.training import LocalTrainer, OptimConfig, TokenBatches, encode_bytes
from peers.training.prompts import pack
from peers.training.state import read_state_info
from peers.wire.errors import RequestError
from peers.wire.messages import ParamsFetch, TrainForward, TrainOpen

OPTIM = OptimConfig(lr=1e-2, warmup_steps=1, schedule="cosine", total_steps=6, clip_norm=1.0, weight_decay=0.01)
TEXT = "Many people use the same served model; each tunes prompts of their own in front of it. " * 40
STAGES = [(0, 3), (3, 6), (6, 8)]
PROMPTS, STEPS, ACCUMULATION = 4, 3, 2


def _served(client: SwarmClient, procs) -> list[torch.Tensor]:
    """The flat parameters each stage peer serves now."""
    flats = []
    for proc in procs.values():
        stream = client.loop.run(client.peer_stream(proc.peer_id))
        _, flat = client.loop.run(stream.call(ParamsFetch(start=proc.blocks[0], end=proc.blocks[1]), None, 10))
        flats.append(flat)
    return flats


def test_swarm_train_tunes_prompts_and_resumes_them(train_stages, llama_dir, tmp_path, swarm_cli):
    """``swarm train`` with ``prompts`` in the config (star by default), its checkpoint holds the prompts, and the
    same command resumes them. (First in the module: the in-process trainer below has the same identity.)"""
    swarm, _ = train_stages
    config = tmp_path / "prompted.toml"
    config.write_text(f'model_dir = {json.dumps(str(llama_dir))}\nseq_len = 16\nbatch_size = 4\nmicro_batch = 2\n'
                      f'steps = 2\nprompts = {PROMPTS}\ndeep_prompts = true\n'
                      f'checkpoint_dir = {json.dumps(str(tmp_path / "ckpt"))}\ncheckpoint_every = 1\n'
                      '[optim]\nlr = 1e-2\nschedule = "constant"\n')

    def train(*extra: str) -> dict:
        done = swarm_cli("train", str(config), "--initial_peers", *swarm.initial_peers, *swarm.trainer_flags(),
                       "--eval_windows", "4", *extra)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("summary "))[8:])

    first = train()
    assert first["topology"] == "star" and first["steps_done"] == 2 and first["stage_steps"] == [2, 2, 2]
    saved = trainer_checkpoint_path(tmp_path / "ckpt", "prompted")
    assert read_state_info(saved)["prompts"] == PROMPTS
    assert {k: list(v.shape) for k, v in load_file(str(saved / "weights.safetensors")).items()} == \
        {"input": [PROMPTS, 64], "deep": [8, PROMPTS, 64]}
    again = train("--steps", "3")
    assert again["resumed"] and again["start_step"] == 2 and again["steps_done"] == 3
    assert again["held_out_before"] == pytest.approx(first["held_out_after"], abs=1e-6)  # the prompts came back


@pytest.fixture(scope="module")
def prompt_client(train_stages, llama_dir):
    swarm, _ = train_stages
    with SwarmClient(llama_dir, config=ClientConfig(swarm=swarm.trainer_config(), request_timeout=30)) as client:
        client.wait_for_records(3)
        yield client


def test_prompt_tuning_equals_one_process_and_leaves_the_blocks_unchanged(train_stages, served_weights,
                                                                          prompt_client, llama_dir):
    """Two prompt runs side by side on the same three peers (input + deep prompts; input prompts only), steps
    interleaved: every loss, the prompts and the held-out loss of each equal its own one-process run bit for bit."""
    _, procs = train_stages
    client = prompt_client
    before = _served(client, procs)
    runs, initial = [], {}
    for name, deep, seed in (("prompts-deep", True, 7), ("prompts-input", False, 3)):
        reference = served_weights(client, LocalTrainer(llama_dir, OPTIM, ACCUMULATION, stages=STAGES,
                                                        prompts=PROMPTS, deep_prompts=deep, seed=seed), procs)
        trainer = SwarmTrainer(client, OPTIM, ACCUMULATION, in_flight=1, topology="star", run_id=name,
                               prompts=PROMPTS, deep_prompts=deep, prompt_seed=seed)
        assert trainer.prompts is not None and reference.prompts is not None
        trainer.start()
        runs.append((trainer, reference, TokenBatches(encode_bytes(TEXT), seq_len=16, micro_batch=2, seed=seed)))
        initial[name] = trainer.prompts.input.detach().clone()
    losses: dict[str, tuple[list[float], list[float]]] = {trainer.run_id: ([], []) for trainer, _, _ in runs}
    for _ in range(STEPS):
        for trainer, reference, data in runs:  # (each run's steps between the other's: the peers keep both)
            micro = [data.next_micro() for _ in range(ACCUMULATION)]
            result = trainer.train_step(micro)
            assert result.stage_steps == [trainer.steps_done] * 3
            losses[trainer.run_id][0].append(result.loss)
            losses[trainer.run_id][1].append(reference.train_step(micro))
    for trainer, reference, data in runs:
        swarm_losses, local_losses = losses[trainer.run_id]
        assert swarm_losses == local_losses  # bit for bit
        assert not torch.equal(trainer.prompts.input, initial[trainer.run_id])  # the prompts trained
        assert torch.equal(trainer.prompts.input, reference.prompts.input)
        assert (trainer.prompts.deep is None) == (reference.prompts.deep is None)
        if trainer.prompts.deep is not None:
            assert torch.equal(trainer.prompts.deep, reference.prompts.deep)
        ids = data.next_micro()
        assert trainer.evaluate(ids) == reference.evaluate(ids)
    after = _served(client, procs)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # nobody else's model changed


def test_wrong_deep_prompts_are_refused_and_the_peer_keeps_serving(train_stages, prompt_client, llama_dir):
    client = prompt_client
    trainer = SwarmTrainer(client, OPTIM, 1, topology="star", run_id="prompts-refused", prompts=PROMPTS,
                           deep_prompts=True)
    trainer.start()
    stream = client.loop.run(client.peer_stream(trainer.stages[1].peer_id))
    hidden = torch.randn(2, 10, 64)

    def forward(micro_id: str, tensor: torch.Tensor, shape: list[int]):
        message = TrainForward(run_id="prompts-refused", micro_id=micro_id, prompt_shape=shape)
        return client.loop.run(stream.call(message, tensor, 10))

    with pytest.raises(RequestError, match="do not fit this stage"):  # prompts for 2 blocks; the stage has 3
        forward("two-blocks", pack(hidden, torch.zeros(2, PROMPTS, 64)), [2, PROMPTS, 64])
    with pytest.raises(RequestError, match="carries no deep prompts"):
        forward("none", hidden, [])
    with pytest.raises(RequestError, match="cannot hold"):  # the shape says 3 blocks, the tensor has no room
        forward("short", hidden[:1], [3, PROMPTS, 64])
    _, out = forward("good", pack(hidden, torch.zeros(3, PROMPTS, 64)), [3, PROMPTS, 64])
    assert out.shape == hidden.shape
    with pytest.raises(RequestError, match="star topology only"):  # a chained prompt run is refused by the stage
        client.loop.run(stream.call(TrainOpen(run_id="prompts-chained", start=3, end=6, optim=OPTIM.to_dict(),
                                              accumulation=1, prompts=PROMPTS, upstream=["x"]), None, 10))
    with pytest.raises(ValueError, match="star topology only"):
        SwarmTrainer(client, OPTIM, 1, topology="chain", prompts=PROMPTS)
    data = TokenBatches(encode_bytes(TEXT), seq_len=8, micro_batch=2, seed=2)
    trainer.start()  # (a new open: the stray "good" micro-batch is discarded)
    assert trainer.train_step([data.next_micro()]).stage_steps == [1, 1, 1]
