"""``PartOptimizer``: the gradients and AdamW of one training part, clipped on their own.

A part is one stage's blocks (on a peer) or the trainer's embedding + head. Each part clips its own
global grad-norm: clipping is per part, not over the whole model, and the one-process reference
(``LocalTrainer``) clips the same parts separately so both give identical results.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from peers.core.finite import all_finite

from .config import OptimConfig
from .schedule import lr_at, make_optimizer, set_lr

logger = logging.getLogger(__name__)


def unique_parameters(*modules: nn.Module) -> list[nn.Parameter]:
    """Parameters of ``modules`` in order, each once (a tied lm_head/embedding weight counts once)."""
    seen: dict[int, nn.Parameter] = {}
    for module in modules:
        for p in module.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())


class NonFiniteStep(ValueError):
    """An optimizer step would have made parameters or AdamW moments non-finite; it was rolled back."""


class PartOptimizer:
    """Accumulates gradients for ``params``; ``step()`` clips, applies the lr schedule, steps AdamW, zeroes.

    With ``guard``, a step that leaves any parameter or AdamW moment NaN or infinite is rolled back
    (``NonFiniteStep``): the part is exactly as before it. The price is a copy of the parameters and moments
    during each step (peers guard their blocks: a trainer's bad step must never reach what they serve).
    """

    def __init__(self, params: Iterable[nn.Parameter], optim: OptimConfig, *, guard: bool = False) -> None:
        self.params = list({id(p): p for p in params}.values())
        self.optim = optim
        self.guard = guard
        # a part with nothing to train (the frozen base of an adapter or prompt run) still counts its steps
        self.optimizer = make_optimizer(self.params or [nn.Parameter(torch.zeros(0))], optim)
        self.step_count = 0  # optimizer steps done
        self.last_grad_norm: float | None = None

    def add(self, *grad_lists: Sequence[torch.Tensor | None]) -> None:
        """Add one micro-batch's gradients (one entry per parameter, None = no contribution) to ``.grad``.

        Several lists (e.g. the head's and the embedding's gradients, which meet in a tied weight) are
        summed first and then added once, as one autograd backward pass would: the results match it
        bit for bit. The caller checks the gradients first (finite, right shapes): this only adds.
        """
        for grads in grad_lists:
            if len(grads) != len(self.params):
                raise ValueError(f"got {len(grads)} gradients for {len(self.params)} parameters")
        with torch.no_grad():
            for i, p in enumerate(self.params):
                parts = [grads[i] for grads in grad_lists if grads[i] is not None]
                if not parts:
                    continue
                total = parts[0].detach() if len(parts) == 1 else parts[0] + parts[1]
                for extra in parts[2:]:
                    total = total + extra
                if p.grad is None:
                    p.grad = total.clone() if len(parts) == 1 else total  # never alias the caller's tensor
                else:
                    p.grad.add_(total)

    def step(self) -> bool:
        """Clip (per part), set the scheduled lr, step AdamW and zero the grads; False if the step was skipped.

        A non-finite accumulated norm (overflow) skips the update and discards the grads. With ``guard``, a
        step whose result is not finite is undone and ``NonFiniteStep`` raised (the grads are discarded).
        """
        with_grad = [p for p in self.params if p.grad is not None]
        max_norm = self.optim.clip_norm if self.optim.clip_norm > 0 else math.inf
        norm = float(torch.nn.utils.clip_grad_norm_(with_grad, max_norm)) if with_grad else 0.0
        self.last_grad_norm = norm
        stepped = math.isfinite(norm)
        if stepped:
            set_lr(self.optimizer, lr_at(self.optim, self.step_count))
            saved = self._snapshot() if self.guard else None
            self.optimizer.step()
            if saved is not None and (bad := self._non_finite()):
                self._restore(saved)
                self.zero_grad()
                raise NonFiniteStep(f"optimizer step {self.step_count + 1} would have made {bad} of {len(self.params)} "
                                    "parameter tensor(s) (or their AdamW moments) NaN or infinite; it was rolled "
                                    "back: weights, AdamW state and step count are as before")
            self.step_count += 1
        else:
            logger.warning("skipping optimizer step %d: accumulated grad-norm is %s", self.step_count, norm)
        self.zero_grad()
        return stepped

    def _snapshot(self) -> list[tuple[torch.Tensor, dict | None]]:
        with torch.no_grad():
            return [(p.detach().clone(), _copy_state(self.optimizer.state.get(p))) for p in self.params]

    def _restore(self, saved: list[tuple[torch.Tensor, dict | None]]) -> None:
        with torch.no_grad():
            for p, (value, state) in zip(self.params, saved, strict=True):
                p.copy_(value)
                if state is None:
                    self.optimizer.state.pop(p, None)
                else:
                    self.optimizer.state[p] = state

    def _non_finite(self) -> int:
        """How many parameters have a non-finite value or AdamW moment after the step."""
        def tensors(p: nn.Parameter) -> list[torch.Tensor]:
            state = self.optimizer.state.get(p, {})
            return [p, *(state[k] for k in ("exp_avg", "exp_avg_sq") if k in state)]

        if all_finite(t for p in self.params for t in tensors(p)):
            return 0
        return sum(not all_finite(tensors(p)) for p in self.params)

    def zero_grad(self) -> None:
        """Discard accumulated gradients."""
        for p in self.params:
            p.grad = None


def _copy_state(state: dict | None) -> dict | None:
    if not state:
        return None
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
