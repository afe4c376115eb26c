"""Per-call low-rank adapters: a run's (or a session's) LoRA applied to the shared blocks without changing them.

A peer's block modules are shared by every inference session and training run, on several threads at once. An
adapter is therefore never written into them: the projections a LoRA may target (``Projection``, GPT-2's ``Conv1D``)
look up the adapter active in the *current call's* context (``active``, a ``ContextVar``: each thread has its own)
and add its low-rank term. Outside ``using(...)`` nothing is active and a projection is the plain affine map.

``LoraDelta`` is one adapted projection: ``x -> (x @ A^T) @ B^T * scaling`` (``A [r, in]``, ``B [out, r]``), the
order of ``peft``'s ``lora_B(lora_A(x)) * scaling``, so an exported adapter gives the same logits in ``peft``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LoraDelta:
    """The low-rank term of one projection: ``A [r, in]``, ``B [out, r]`` (tensors that may carry grad)."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.a), self.b) * self.scaling


Active = Mapping[int, LoraDelta]  # id(projection module) -> its term
_ACTIVE: ContextVar[Active | None] = ContextVar("fusionswarm_active_adapter", default=None)


def active() -> Active | None:
    """The adapter of the current call (None: the base model)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def using(adapter: Active | None) -> Iterator[None]:
    """Run the enclosed block calls with ``adapter`` (this thread/context only; None: the base model)."""
    token = _ACTIVE.set(adapter)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def adapt(module: nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` plus the active adapter's term for ``module`` (``out`` itself when none applies)."""
    adapter = _ACTIVE.get()
    if adapter is None:
        return out
    delta = adapter.get(id(module))
    return out if delta is None else out + delta(x)


class Projection(nn.Linear):
    """``nn.Linear`` that a LoRA may target: the active adapter's term is added (``adapt``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return adapt(self, x, F.linear(x, self.weight, self.bias))
