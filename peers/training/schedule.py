"""Learning-rate schedule (``lr_at``) and the AdamW every training part uses (``make_optimizer``, ``set_lr``)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from .config import OptimConfig


def lr_at(optim: OptimConfig, step: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based count of steps already done).

    Linear warmup ``lr * (step + 1) / warmup_steps``, then ``constant``, ``linear`` or ``cosine`` decay
    to ``min_lr_ratio * lr`` at ``total_steps`` and flat after it. ``total_steps=0`` keeps ``lr``.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    if optim.schedule == "constant" or optim.total_steps == 0:
        return optim.lr
    progress = min(1.0, (step - optim.warmup_steps) / (optim.total_steps - optim.warmup_steps))
    shape = 1.0 - progress if optim.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return optim.lr * (optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * shape)


def make_optimizer(params: Iterable[nn.Parameter], optim: OptimConfig) -> torch.optim.AdamW:
    """AdamW over ``params``: weight decay on matrices (dim >= 2) only, none on norms and biases.

    Parameters are de-duplicated (tied embeddings appear once) and keep their order.
    """
    unique = list({id(p): p for p in params}.values())
    if not unique:
        raise ValueError("make_optimizer got no parameters: is the part empty?")
    decay = [p for p in unique if p.dim() >= 2]
    no_decay = [p for p in unique if p.dim() < 2]
    groups = [{"params": g, "weight_decay": wd} for g, wd in ((decay, optim.weight_decay), (no_decay, 0.0)) if g]
    return torch.optim.AdamW(groups, lr=lr_at(optim, 0), betas=optim.betas, eps=optim.eps)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group."""
    for group in optimizer.param_groups:
        group["lr"] = lr
