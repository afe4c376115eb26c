"""LocalTrainer: the split (trainer + two StageTrainers) reproduces it, client-part state, and loss falls."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from peers.model import load_blocks, load_client_parts, make_tiny_model
from peers.model.local import default_position_ids
from peers.training import (
    LocalTrainer,
    OptimConfig,
    PartOptimizer,
    StageTrainer,
    TokenBatches,
    builtin_corpus,
    encode_bytes,
    load_stage_state,
    loss_of,
    read_corpus,
    save_stage_state,
    unique_parameters,
)

OPTIM = OptimConfig(lr=1e-2, warmup_steps=1, total_steps=5, clip_norm=0.5)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    heads = 4 if request.param == "gpt2" else 2  # gpt2: tied lm_head / wte
    return make_tiny_model(tmp_path_factory.mktemp("train-local") / request.param, family=request.param,
                           hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=heads, intermediate_size=64,
                           seed=4)


def _micro_batches(step: int, n: int = 2) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return [torch.randint(0, 256, (2, 9), generator=gen) for _ in range(n)]


def test_split_stages_reproduce_local_trainer(model_dir: Path) -> None:
    ranges = [(0, 2), (2, 4)]
    ref = LocalTrainer(model_dir, OPTIM, accumulation=2, stages=ranges)
    embedding, head = load_client_parts(model_dir)
    embedding.requires_grad_(True).train()
    head.requires_grad_(True).train()
    client = PartOptimizer(unique_parameters(embedding, head), OPTIM)
    stages = [StageTrainer(load_blocks(model_dir, a, b), OPTIM, accumulation=2) for a, b in ranges]
    for step in range(3):
        micros = _micro_batches(step)
        ref_loss = ref.train_step(micros)
        total, embedded, outs = 0.0, [], []
        for i, ids in enumerate(micros):  # all forwards first, as with micro-batches in flight
            pos = default_position_ids(ids)
            embedded.append(embedding.embed(ids, pos))
            hidden = embedded[-1].detach()
            for stage in stages:
                hidden = stage.forward(f"{step}/{i}", hidden, pos)
            outs.append(hidden.requires_grad_(True))
        assert all(stage.pending == 2 for stage in stages)
        for i, ids in enumerate(micros):
            loss = loss_of(head.head(outs[i]), ids) / 2
            total += loss.item()
            grad, *head_grads = torch.autograd.grad(loss, [outs[i], *client.params], allow_unused=True)
            for stage in reversed(stages):
                grad = stage.backward(f"{step}/{i}", grad)
            emb_grads = torch.autograd.grad(embedded[i], client.params, grad, allow_unused=True)
            client.add(head_grads, emb_grads)  # a tied weight's two parts are summed, then accumulated
        client.step()
        assert total == pytest.approx(ref_loss, abs=1e-6)
        split = {f"embedding.{k}": p for k, p in embedding.named_parameters()}
        split.update({f"head.{k}": p for k, p in head.named_parameters()})
        for stage in stages:
            split.update({f"blocks.{stage.blocks.start + int(k.split('.', 1)[0])}.{k.split('.', 1)[1]}": p
                          for k, p in stage.blocks.named_parameters()})
        want = ref.state_dict()
        assert sorted(split) == sorted(want)
        for name, p in split.items():
            torch.testing.assert_close(p, want[name], rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert ref.step == client.step_count == 3 and all(s.step == 3 for s in stages)


def test_client_part_state_round_trip(model_dir: Path, tmp_path: Path) -> None:
    trainer = LocalTrainer(model_dir, OPTIM, accumulation=1)
    trainer.train_step(_micro_batches(0, 1))
    client = nn.ModuleDict({"embedding": trainer.embedding, "head": trainer.head})
    save_stage_state(tmp_path / "client", client, trainer.client.optimizer, trainer.step, {"kind": "client"})
    other = LocalTrainer(model_dir, OPTIM, accumulation=1)
    other_client = nn.ModuleDict({"embedding": other.embedding, "head": other.head})
    info = load_stage_state(tmp_path / "client", other_client, other.client.optimizer, expect={"kind": "client"})
    assert info["step"] == 1
    for p, q in zip(unique_parameters(client), unique_parameters(other_client), strict=True):
        assert torch.equal(p, q)
        assert torch.equal(trainer.client.optimizer.state[p]["exp_avg"], other.client.optimizer.state[q]["exp_avg"])


def test_local_trainer_argument_errors(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="must be non-empty ranges covering"):
        LocalTrainer(model_dir, OPTIM, 1, stages=[(0, 2), (3, 4)])
    with pytest.raises(ValueError, match="end at block 3"):
        LocalTrainer(model_dir, OPTIM, 1, stages=[(0, 3)])
    trainer = LocalTrainer(model_dir, OPTIM, accumulation=2)
    with pytest.raises(ValueError, match="needs 2 micro-batches"):
        trainer.train_step(_micro_batches(0, 1))
    with pytest.raises(ValueError, match="do not fit input_ids"):
        loss_of(torch.zeros(2, 5, 10), torch.zeros(2, 4, dtype=torch.long))


def test_loss_falls_on_builtin_corpus(tmp_path_factory: pytest.TempPathFactory) -> None:
    model = make_tiny_model(tmp_path_factory.mktemp("train-corpus") / "tiny", hidden_size=32, num_layers=2,
                            num_heads=4, num_kv_heads=2, intermediate_size=64, seed=5)
    path = builtin_corpus(cache_dir=tmp_path_factory.getbasetemp() / "training-corpus")  # shared with data tests
    batches = TokenBatches(encode_bytes(read_corpus(path)), seq_len=32, micro_batch=8, seed=0)
    trainer = LocalTrainer(model, OptimConfig(lr=1e-2, warmup_steps=3, total_steps=30), accumulation=1)
    held_out = batches.held_out_windows(limit=16)
    before = trainer.evaluate(held_out)
    losses = [trainer.train_step([batches.next_micro()]) for _ in range(30)]
    after = trainer.evaluate(held_out)
    assert after < before - 1.0, (before, after, losses)
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
