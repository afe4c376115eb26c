"""StageTrainer: same math as plain autograd, refusal of bad gradients, stale graphs, save/load/resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from peers.model import load_blocks, make_tiny_model
from peers.model.local import default_position_ids
from peers.training import GradientError, OptimConfig, PartOptimizer, StageTrainer

OPTIM = OptimConfig(lr=1e-2, warmup_steps=1, total_steps=6, clip_norm=0.5, weight_decay=0.1)
B, T, H = 2, 8, 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("train-stage") / "tiny", hidden_size=H, num_layers=4,
                           num_heads=4, num_kv_heads=2, intermediate_size=64, seed=3)


def _micro(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=gen)
    grad = torch.randn(B, T, H, generator=gen) * 0.1
    return hidden, default_position_ids(hidden[..., 0]), grad


def _params(stage: StageTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in stage.blocks.parameters()]


def _grads(stage: StageTrainer) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in stage.blocks.parameters()]


def _same(a: list, b: list) -> bool:
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("mode", ["keep", "recompute", "stateless"])
def test_stage_matches_plain_autograd(model_dir: Path, mode: str) -> None:
    ref_blocks = load_blocks(model_dir, 1, 3).requires_grad_(True).train()
    ref = PartOptimizer(ref_blocks.parameters(), OPTIM)
    stage = StageTrainer(load_blocks(model_dir, 1, 3), OPTIM, accumulation=2, keep_activations=mode == "keep")
    for step in range(3):
        micros = {f"s{step}m{i}": _micro(10 * step + i) for i in range(2)}
        if mode != "stateless":
            outs = {mid: stage.forward(mid, h, pos) for mid, (h, pos, _) in micros.items()}
            assert stage.pending == 2
        for mid, (hidden, pos, grad) in micros.items():
            leaf = hidden.clone().requires_grad_(True)
            out, _ = ref_blocks(leaf, pos)
            if mode != "stateless":
                torch.testing.assert_close(outs[mid], out.detach(), rtol=0, atol=0)
            out.backward(grad)
            extra = {"hidden": hidden, "position_ids": pos} if mode == "stateless" else {}
            grad_in = stage.backward(mid, grad, **extra)
            torch.testing.assert_close(grad_in, leaf.grad, rtol=0, atol=1e-7)
        ref.step()
        assert stage.step == step + 1 and stage.version == step + 1 and stage.pending == 0
        assert stage.last_grad_norm == pytest.approx(ref.last_grad_norm, rel=1e-6)
        for p, q in zip(stage.blocks.parameters(), ref_blocks.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-7)
            assert p.grad is None


def test_bad_gradients_change_nothing(model_dir: Path) -> None:
    stage = StageTrainer(load_blocks(model_dir, 0, 2), OPTIM, accumulation=2)
    hidden, pos, grad = _micro(1)
    stage.forward("good", hidden, pos)
    stage.backward("good", grad)  # one accumulated micro-batch: grads are now non-empty
    params, grads = _params(stage), _grads(stage)
    assert all(g is not None for g in grads)
    bad = {
        "shape": grad[:, :-1], "dtype": grad.double(), "nan": grad.clone().index_fill_(1, torch.tensor([3]), torch.nan),
        "inf": grad.clone().index_fill_(0, torch.tensor([1]), torch.inf), "overflow": torch.full_like(grad, 3e38),
    }
    for name, g in bad.items():
        stage.forward(name, hidden, pos)
        with pytest.raises(GradientError):
            stage.backward(name, g)
        assert stage.pending == 0  # the refused micro-batch was dropped
        assert _same(_params(stage), params) and _same(_grads(stage), grads), name
    with pytest.raises(GradientError, match="not pending here"):
        stage.backward("never-sent", grad)
    assert stage.step == 0 and stage.micro_count == 1
    stage.forward("good2", hidden, pos)
    stage.backward("good2", grad)
    assert stage.step == 1 and not _same(_params(stage), params)


def test_forward_refuses_duplicates_and_overflow(model_dir: Path) -> None:
    stage = StageTrainer(load_blocks(model_dir, 0, 1), OPTIM, accumulation=1, max_pending=2)
    hidden, pos, _ = _micro(2)
    stage.forward("a", hidden, pos)
    with pytest.raises(ValueError, match="already pending"):
        stage.forward("a", hidden, pos)
    stage.forward("b", hidden, pos)
    with pytest.raises(ValueError, match="max_pending=2"):
        stage.forward("c", hidden, pos)
    with pytest.raises(ValueError, match="position_ids must be"):
        stage.forward("d", hidden, pos[:, :-1])
    assert stage.drop("a") and not stage.drop("a") and stage.pending == 1
    stage.reset_accumulation()
    assert stage.pending == 0


def test_stale_graph_is_recomputed(model_dir: Path) -> None:
    stage = StageTrainer(load_blocks(model_dir, 0, 2), OPTIM, accumulation=1, keep_activations=True)
    ref_blocks = load_blocks(model_dir, 0, 2).requires_grad_(True).train()
    ref = PartOptimizer(ref_blocks.parameters(), OPTIM)
    (h1, p1, g1), (h2, p2, g2) = _micro(5), _micro(6)
    stage.forward("m1", h1, p1)
    stage.forward("m2", h2, p2)  # graph built with version 0 weights
    stage.backward("m1", g1)  # optimizer step: version 1, m2's graph is stale
    assert stage.version == 1
    grad_in = stage.backward("m2", g2)  # no autograd "modified by an inplace operation" error
    for hidden, pos, grad in ((h1, p1, g1), (h2, p2, g2)):
        leaf = hidden.clone().requires_grad_(True)
        out, _ = ref_blocks(leaf, pos)
        out.backward(grad)
        ref.step()
    torch.testing.assert_close(grad_in, leaf.grad, rtol=0, atol=1e-7)
    for p, q in zip(stage.blocks.parameters(), ref_blocks.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)


def _train(stage: StageTrainer, steps: range) -> None:
    for step in steps:
        for i in range(stage.accumulation):
            hidden, pos, grad = _micro(100 * step + i)
            stage.forward(f"{step}-{i}", hidden, pos)
            stage.backward(f"{step}-{i}", grad)


def test_save_load_resume_is_exact(model_dir: Path, tmp_path: Path) -> None:
    a = StageTrainer(load_blocks(model_dir, 2, 4), OPTIM, accumulation=2)
    _train(a, range(2))
    a.save(tmp_path / "ckpt")
    a.save(tmp_path / "ckpt")  # overwriting an existing checkpoint works
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp folders left behind
    saved = _params(a)
    _train(a, range(2, 3))

    b = StageTrainer(load_blocks(model_dir, 2, 4), OPTIM, accumulation=2)
    info = b.load(tmp_path / "ckpt")
    assert info["step"] == 2 and (info["start"], info["end"]) == (2, 4) and b.step == 2
    assert _same(_params(b), saved)
    assert all(float(b.part.optimizer.state[q]["step"]) == 2.0 for q in b.blocks.parameters())
    _train(b, range(2, 3))
    assert _same(_params(b), _params(a))
    for p, q in zip(a.blocks.parameters(), b.blocks.parameters(), strict=True):
        sa, sb = a.part.optimizer.state[p], b.part.optimizer.state[q]
        assert all(torch.equal(sa[k], sb[k]) for k in ("step", "exp_avg", "exp_avg_sq"))


def test_load_refuses_other_range_or_shapes(model_dir: Path, tmp_path: Path) -> None:
    a = StageTrainer(load_blocks(model_dir, 2, 4), OPTIM, accumulation=1)
    a.save(tmp_path / "ckpt")
    other = StageTrainer(load_blocks(model_dir, 0, 2), OPTIM, accumulation=1)
    before = _params(other)
    with pytest.raises(ValueError, match="start=2 but this part has start=0"):
        other.load(tmp_path / "ckpt")
    wide = make_tiny_model(tmp_path / "wide", hidden_size=16, num_layers=4, num_heads=2, num_kv_heads=1,
                           intermediate_size=32)
    with pytest.raises(ValueError, match="does not fit this part"):
        StageTrainer(load_blocks(wide, 2, 4), OPTIM, accumulation=1).load(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="no training state"):
        other.load(tmp_path / "missing")
    assert _same(_params(other), before)
