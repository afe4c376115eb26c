"""Weight versions for asynchronous steps (staleness 1): copies of a part's parameters by optimizer step count.

With staleness 1, step n's micro-batches are computed on the weights the part had before it applied step n - 1,
while step n - 1's update lands. A part keeps a copy of its parameters at step count ``c`` (``WeightVersions``) for
as long as micro-batches of that version may still be under way: the copy is never changed in place, so a graph
built on it stays valid across the optimizer step, and a backward runs against exactly the weights its forward saw.
``call_with`` runs a module (or one of its methods) on such a copy (``torch.func.functional_call``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


def check_stale_micro_batches(count: int | None) -> None:
    """Staleness 1: ``count`` micro-batches of a step start on the weights from before the previous step (None: all
    of them); at least 1, or the step would overlap nothing."""
    if count is not None and count < 1:
        raise ValueError(f"stale_micro_batches must be >= 1 (None: all of a step's), got {count}")


def snapshot(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Detached copies of ``params`` (leaves that take gradients where the originals do)."""
    with torch.no_grad():
        return [p.detach().clone().requires_grad_(p.requires_grad) for p in params]


class WeightVersions:
    """Copies of ``params`` keyed by the part's step count: the current one made on demand, the one before an
    optimizer step kept through it (``before_step`` / ``after_step``), older ones dropped."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.params = list(params)
        self.kept: dict[int, list[torch.Tensor]] = {}

    def at(self, step: int, current: int) -> list[torch.Tensor]:
        """The weights of step count ``step`` (``current``: the part's count now); ``ValueError`` if not kept."""
        if step == current:
            return self.kept.setdefault(current, snapshot(self.params))
        if step in self.kept:
            return self.kept[step]
        kept = sorted(self.kept) or "none"
        raise ValueError(f"the weights of step {step} are not kept here (this part is at step {current}; kept: "
                         f"{kept}): a micro-batch may be at most one step behind the weights")

    def before_step(self, current: int) -> None:
        """An optimizer step is about to change the weights of step ``current``: keep them."""
        self.kept.setdefault(current, snapshot(self.params))

    def after_step(self, previous: int) -> None:
        """The step from ``previous`` is done (or skipped): drop copies older than ``previous``."""
        for step in [s for s in self.kept if s < previous]:
            del self.kept[step]

    def replaced(self, current: int) -> None:
        """The weights of step ``current`` were replaced without a step (loaded, averaged): forget their copy."""
        self.kept.pop(current, None)

    def clear(self) -> None:
        self.kept.clear()


class _Method(nn.Module):
    """``module.<name>(...)`` as a forward, so that ``functional_call`` can run it."""

    def __init__(self, module: nn.Module, name: str) -> None:
        super().__init__()
        self.module, self.name = module, name

    def forward(self, *args: Any) -> Any:
        return getattr(self.module, self.name)(*args)


def call_with(module: nn.Module, weights: dict[int, torch.Tensor], *args: Any, method: str = "forward") -> Any:
    """``module.<method>(*args)`` with each parameter ``p`` replaced by ``weights[id(p)]`` (tied ones alike)."""
    wrapped = _Method(module, method)
    named = {name: weights[id(p)] for name, p in wrapped.named_parameters(remove_duplicate=False)}
    return torch.func.functional_call(wrapped, named, args, tie_weights=False, strict=False)
