"""Prompt tuning's pieces: packing deep prompts after hidden states, a frozen prompt stage (same grads as plain
autograd, weights unchanged, wrong shapes refused), the one-process reference training only the prompts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from peers.model import load_blocks, make_tiny_model
from peers.training import LocalTrainer, OptimConfig, TrainConfig
from peers.training.prompts import (
    Prompts,
    PromptStageTrainer,
    check_prompt_shape,
    pack,
    prompt_rows,
    run_blocks,
    unpack,
)

OPTIM = OptimConfig(lr=1e-2, warmup_steps=1, total_steps=6, clip_norm=0.5, weight_decay=0.1)
B, T, H, P = 2, 8, 32, 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("prompts") / "tiny", hidden_size=H, num_layers=4,
                           num_heads=4, num_kv_heads=2, intermediate_size=64, seed=3)


def test_pack_and_unpack_round_trip() -> None:
    hidden, deep = torch.randn(B, T, H), torch.randn(3, P, H)
    packed = pack(hidden, deep)
    assert packed.shape == (B + 2, T, H)  # 9 prompt vectors take 2 rows of 8 positions
    back_hidden, back_deep = unpack(packed, list(deep.shape))
    assert torch.equal(back_hidden, hidden) and torch.equal(back_deep, deep)
    with pytest.raises(ValueError, match="cannot hold"):
        unpack(hidden[:1], [3, 8, H])  # 3 x 8 vectors need 3 rows: the tensor has only 1
    with pytest.raises(ValueError, match=r"takes \[blocks, prompts, hidden\] = \[2, 3, 32\]"):
        check_prompt_shape([3, 3, H], blocks=2, prompts=3, hidden_size=H, seq=T)
    assert prompt_rows([3, P, H], T) == 2 and prompt_rows([3, P], T) == prompt_rows([-1, P, H], T) == 0
    with pytest.raises(ValueError, match="leave no token"):
        check_prompt_shape([2, 8, H], blocks=2, prompts=8, hidden_size=H, seq=8)


def test_prompt_stage_is_frozen_and_returns_the_grads_of_its_input_and_deep_prompts(model_dir: Path) -> None:
    stage = PromptStageTrainer(load_blocks(model_dir, 1, 3), OPTIM, accumulation=2, prompts=P, deep=True,
                               auto_step=False)
    before = [p.detach().clone() for p in stage.blocks.parameters()]
    reference = load_blocks(model_dir, 1, 3)
    positions = torch.arange(T).expand(B, T)
    for i in range(2):
        gen = torch.Generator().manual_seed(i)
        hidden, deep, grad = (torch.randn(B, T, H, generator=gen), torch.randn(2, P, H, generator=gen),
                              torch.randn(B, T, H, generator=gen))
        out = stage.forward_packed(f"m{i}", pack(hidden, deep), [2, P, H])
        leaf, deep_leaf = hidden.clone().requires_grad_(True), deep.clone().requires_grad_(True)
        expected = run_blocks(reference, leaf, positions, deep_leaf)
        assert torch.equal(out, expected.detach())
        grad_input, grad_deep = unpack(stage.backward(f"m{i}", grad), [2, P, H])
        want_input, want_deep = torch.autograd.grad(expected, [leaf, deep_leaf], grad)
        assert torch.equal(grad_input, want_input) and torch.equal(grad_deep, want_deep)
    stage.apply(2)
    assert stage.step == 1 and stage.pending == 0
    assert all(torch.equal(a, b) for a, b in zip(before, stage.blocks.parameters(), strict=True))
    assert all(p.grad is None for p in stage.blocks.parameters())


def test_prompt_stage_refuses_wrong_deep_prompts_and_keeps_nothing(model_dir: Path) -> None:
    stage = PromptStageTrainer(load_blocks(model_dir, 0, 2), OPTIM, accumulation=1, prompts=P, deep=True)
    hidden = torch.randn(B, T, H)
    with pytest.raises(ValueError, match="do not fit this stage"):
        stage.forward_packed("a", pack(hidden, torch.randn(3, P, H)), [3, P, H])  # prompts for 3 blocks, not 2
    with pytest.raises(ValueError, match="carries no deep prompts"):
        stage.forward_packed("b", hidden, [])
    assert stage.pending == 0
    plain = PromptStageTrainer(load_blocks(model_dir, 0, 2), OPTIM, accumulation=1, prompts=P, deep=False)
    with pytest.raises(ValueError, match="has none"):
        plain.forward_packed("c", pack(hidden, torch.randn(2, P, H)), [2, P, H])


def test_local_trainer_with_prompts_trains_only_the_prompts(model_dir: Path) -> None:
    trainer = LocalTrainer(model_dir, OPTIM, 2, stages=[(0, 2), (2, 4)], prompts=P, deep_prompts=True, seed=5)
    frozen = {k: v.clone() for k, v in trainer.state_dict().items()}
    assert trainer.prompts is not None and trainer.prompts.deep is not None
    prompts = trainer.prompts.input.detach().clone()
    assert torch.equal(prompts, Prompts.for_embedding(trainer.embedding, P, 4, deep=True, seed=5).input)
    ids = torch.randint(0, 256, (4, B, T + 1), generator=torch.Generator().manual_seed(0))
    first = trainer.train_step([ids[0], ids[1]])
    for _ in range(4):
        last = trainer.train_step([ids[0], ids[1]])
    assert last < first
    assert trainer.logits(ids[2]).shape[:2] == (B, T + 1)  # logits of the tokens only
    assert all(torch.equal(v, trainer.state_dict()[k]) for k, v in frozen.items())
    assert not torch.equal(prompts, trainer.prompts.input) and trainer.prompts.deep.abs().sum() > 0


def test_train_config_prompt_keys(tmp_path: Path) -> None:
    config = TrainConfig(model_dir=tmp_path, prompts=16, deep_prompts=True)
    assert (config.prompts, config.deep_prompts) == (16, True)
    with pytest.raises(ValueError, match="deep_prompts needs prompts"):
        TrainConfig(model_dir=tmp_path, deep_prompts=True)
    with pytest.raises(ValueError, match="staleness = 0"):
        TrainConfig(model_dir=tmp_path, prompts=4, staleness=1)
