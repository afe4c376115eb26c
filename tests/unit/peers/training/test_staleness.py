"""Staleness 1 (asynchronous steps) on one stage, computed by hand: step n's gradients are taken at the weights
from before step n - 1's update (w2 = w1 - update(g(w0))), and a backward whose forward ran before an apply uses
the pre-apply weights. Also the one-process reference (``LocalTrainer(staleness=1)``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from peers.model import make_tiny_model
from peers.model.blocks import StageBlocks
from peers.training import LocalTrainer, OptimConfig, StageTrainer, TokenBatches, encode_bytes
from peers.training.versions import WeightVersions

H = 3
OPTIM = OptimConfig(lr=0.1, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0, clip_norm=0.0, warmup_steps=0,
                    schedule="constant")


class Tanh(nn.Module):
    """y = tanh(x w^T): the parameter gradient depends on w, so a gradient at old weights shows."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(w.clone())

    def forward(self, hidden, position_ids, past=None):
        return torch.tanh(hidden @ self.w.T), None


def _stage(w0: torch.Tensor) -> StageTrainer:
    stage = StageTrainer(StageBlocks([Tanh(w0)], 0, 1), OPTIM, accumulation=1, auto_step=False)
    stage.staleness = 1
    return stage


def _x(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, H, generator=gen), torch.zeros(1, 2, dtype=torch.long), torch.randn(1, 2, H, generator=gen)


def _by_hand(w: torch.Tensor, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Output, dL/dw and dL/dx of y = tanh(x w^T) for the output grad ``g``, written out."""
    y = torch.tanh(x @ w.T)
    d = g * (1 - y * y)  # through tanh
    return y, torch.einsum("bti,btj->ij", d, x), d @ w


class _AdamW:
    """Plain torch's AdamW on one tensor, fed the gradients we computed by hand."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w = w.clone().requires_grad_(True)
        self.opt = torch.optim.AdamW([self.w], lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps, weight_decay=0.0)

    def step(self, grad: torch.Tensor) -> torch.Tensor:
        self.w.grad = grad.clone()
        self.opt.step()
        return self.w.detach().clone()


def test_two_steps_by_hand() -> None:
    w0 = torch.tensor([[0.5, -0.3, 0.2], [0.1, 0.4, -0.6], [-0.2, 0.3, 0.7]])
    stage = _stage(w0)
    (x0, pos, g0), (x1, _, g1), (x1b, _, g1b), (x2, _, _) = (_x(s) for s in range(4))

    # step 0 (the run's first: the current weights w0); step 1's first forward starts before step 0 is applied
    assert torch.equal(stage.forward("s0", x0, pos, at_step=0), _by_hand(w0, x0, g0)[0])
    stage.backward("s0", g0)
    stage.forward("s1a", x1, pos, at_step=0)  # step 1: the weights before step 0's update (w0)
    stage.apply(1)
    reference = _AdamW(w0)
    w1 = reference.step(_by_hand(w0, x0, g0)[1])
    assert torch.allclose(stage.blocks[0].w, w1, atol=1e-7, rtol=0)

    # step 1's second forward runs after the apply, still on w0; both backwards use w0, not w1
    out, _, _ = _by_hand(w0, x1b, g1b)
    assert torch.allclose(stage.forward("s1b", x1b, pos, at_step=0), out, atol=1e-7, rtol=0)
    grad_x = stage.backward("s1a", g1)
    assert torch.allclose(grad_x, _by_hand(w0, x1, g1)[2], atol=1e-7, rtol=0)
    assert not torch.allclose(grad_x, _by_hand(w1, x1, g1)[2], atol=1e-4, rtol=0)
    stage.backward("s1b", g1b)
    stage.apply(2)
    g_stale = _by_hand(w0, x1, g1)[1] + _by_hand(w0, x1b, g1b)[1]  # g(w0), applied to w1
    w2 = reference.step(g_stale)
    assert torch.allclose(stage.blocks[0].w, w2, atol=1e-7, rtol=0)
    synchronous = _AdamW(w0)
    synchronous.step(_by_hand(w0, x0, g0)[1])
    w2_sync = synchronous.step(_by_hand(w1, x1, g1)[1] + _by_hand(w1, x1b, g1b)[1])
    assert not torch.allclose(w2, w2_sync, atol=1e-5, rtol=0)  # the schedule differs from staleness 0

    # step 2 uses w1 (kept through the apply); w0 is gone
    assert torch.allclose(stage.forward("s2", x2, pos, at_step=1), torch.tanh(x2 @ w1.T), atol=1e-7, rtol=0)
    with pytest.raises(ValueError, match="not kept"):
        stage.forward("old", x2, pos, at_step=0)


def test_at_step_needs_staleness_and_recompute_uses_the_kept_weights() -> None:
    w0 = torch.eye(H) * 0.5
    stage = StageTrainer(StageBlocks([Tanh(w0)], 0, 1), OPTIM, accumulation=1, auto_step=False,
                         keep_activations=False)
    x, pos, g = _x(7)
    with pytest.raises(ValueError, match="staleness 0"):
        stage.forward("m", x, pos, at_step=0)
    stage.staleness = 1
    stage.forward("warm", x, pos, at_step=0)
    stage.backward("warm", g)
    stage.forward("m", x, pos, at_step=0)  # no graph kept: its backward recomputes, on w0
    stage.apply(1)
    assert torch.allclose(stage.backward("m", g), _by_hand(w0, x, g)[2], atol=1e-7, rtol=0)


def test_weight_versions_keep_one_step_back() -> None:
    p = nn.Parameter(torch.zeros(2))
    versions = WeightVersions([p])
    first = versions.at(0, 0)
    versions.before_step(0)
    with torch.no_grad():
        p.add_(1)
    versions.after_step(0)
    assert versions.at(0, 1) is first and torch.equal(first[0], torch.zeros(2))
    assert torch.equal(versions.at(1, 1)[0], torch.ones(2))
    versions.before_step(1)
    versions.after_step(1)
    with pytest.raises(ValueError, match="not kept"):
        versions.at(0, 2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("stale") / "tiny", hidden_size=32, num_layers=2, num_heads=4,
                           num_kv_heads=2, intermediate_size=64, seed=5)


def test_local_reference_takes_gradients_one_step_back(model_dir: Path) -> None:
    """A step's loss is that of the weights before the previous update: step 2's that of w0, step 3's that of w1."""
    optim = OptimConfig(lr=1e-2, warmup_steps=0, schedule="constant")
    data = TokenBatches(encode_bytes("staleness one: gradients one step old. " * 30), seq_len=12, micro_batch=2,
                        seed=1)
    steps = [[data.next_micro() for _ in range(2)] for _ in range(3)]
    stale = LocalTrainer(model_dir, optim, 2, stages=[(0, 1), (1, 2)], staleness=1, stale_micro_batches=None)
    sync = LocalTrainer(model_dir, optim, 2, stages=[(0, 1), (1, 2)])

    def mean_loss(trainer: LocalTrainer, micro: list[torch.Tensor]) -> float:
        return sum(trainer.evaluate(m) for m in micro) / len(micro)

    w0 = mean_loss(sync, steps[1])
    assert stale.train_step(steps[0]) == pytest.approx(sync.train_step(steps[0]), abs=1e-6)  # the first step: w0
    assert stale.train_step(steps[1]) == pytest.approx(w0, abs=1e-6)  # at w0, not w1
    assert stale.train_step(steps[2]) == pytest.approx(mean_loss(sync, steps[2]), abs=1e-6)  # at w1 (sync holds w1)
    assert mean_loss(sync, steps[1]) != pytest.approx(w0, abs=1e-6)


def test_only_the_first_micro_batches_of_a_step_are_stale(model_dir: Path) -> None:
    """``stale_micro_batches=1`` (the default): step 2's first micro-batch runs at w0, its second at w1; a count
    below 1 is refused."""
    optim = OptimConfig(lr=1e-2, warmup_steps=0, schedule="constant")
    data = TokenBatches(encode_bytes("one stale micro-batch, the rest fresh. " * 30), seq_len=12, micro_batch=2, seed=2)
    steps = [[data.next_micro() for _ in range(2)] for _ in range(2)]
    at_w0 = LocalTrainer(model_dir, optim, 2, stages=[(0, 1), (1, 2)])
    sync = LocalTrainer(model_dir, optim, 2, stages=[(0, 1), (1, 2)])
    partial = LocalTrainer(model_dir, optim, 2, stages=[(0, 1), (1, 2)], staleness=1)
    assert partial.train_step(steps[0]) == pytest.approx(sync.train_step(steps[0]), abs=1e-6)
    expected = (at_w0.evaluate(steps[1][0]) + sync.evaluate(steps[1][1])) / 2  # sync holds w1 now
    assert partial.train_step(steps[1]) == pytest.approx(expected, abs=1e-6)
    assert at_w0.evaluate(steps[1][1]) != pytest.approx(sync.evaluate(steps[1][1]), abs=1e-6)  # w0 and w1 differ
    with pytest.raises(ValueError, match="stale_micro_batches must be >= 1"):
        LocalTrainer(model_dir, optim, 2, staleness=1, stale_micro_batches=0)
