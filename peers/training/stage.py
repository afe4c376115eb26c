"""``StageTrainer``: trains one peer's block range with its own AdamW, one micro-batch at a time.

``forward(micro_id, hidden, position_ids)`` saves the input (and, with ``keep_activations``, the graph);
``backward(micro_id, grad_output)`` returns the gradient for the previous stage and adds this stage's
parameter gradients. After ``accumulation`` backward passes the stage clips its own grad-norm
(clipping is per stage), steps AdamW on the lr schedule and zeroes the grads.

A graph saved before an optimizer step is stale (its weights changed): backward then recomputes the
forward from the saved input with the current weights. With ``staleness`` 1 (asynchronous steps) a forward may
name the weights of a step count (``at_step``: the current one or the one before the last step): it runs on a
kept copy of them (``peers.training.versions``), and its backward runs against that same copy.

Gradients are checked before they touch the accumulators, so a bad micro-batch (``GradientError``) leaves
parameters and accumulated grads as they were, and a step that would make a weight non-finite is rolled back and
refused (``GradientError``): it is never served.

A run with an ``adapter`` (``peers.training.lora``) trains only the adapter: the blocks stay frozen (they are never
given ``requires_grad``, nor changed) and the adapter is active only in this trainer's own calls
(``peers.model.adapters.using``), so inference sessions on the same blocks compute as before. ``frozen_base`` without
an adapter: a run with nothing to train here (its steps are still counted).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from peers.core.finite import all_finite
from peers.model.adapters import using
from peers.model.blocks import StageBlocks

from .config import OptimConfig
from .lora import LoraAdapter
from .part import NonFiniteStep, PartOptimizer
from .state import load_stage_state, save_stage_state
from .versions import WeightVersions, call_with

logger = logging.getLogger(__name__)


class GradientError(ValueError):
    """A micro-batch's gradient was refused; that micro-batch was dropped and nothing was applied."""


@dataclass
class _Saved:
    hidden: torch.Tensor  # detached input
    position_ids: torch.Tensor
    leaf: torch.Tensor | None = None  # input leaf of the saved graph
    output: torch.Tensor | None = None  # output with graph, when activations are kept
    version: int = -1  # weight version the graph was built with
    weights: list[torch.Tensor] | None = None  # staleness 1: the kept copy of the weights its forward ran on


class StageTrainer:
    """Training state of a ``StageBlocks`` on one peer: saved micro-batches, grads, AdamW, step count."""

    def __init__(self, blocks: StageBlocks, optim: OptimConfig, accumulation: int, *, keep_activations: bool = True,
                 max_pending: int = 64, auto_step: bool = True, adapter: LoraAdapter | None = None,
                 frozen_base: bool = False) -> None:
        if accumulation < 1:
            raise ValueError(f"accumulation must be >= 1, got {accumulation}")
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.adapter = adapter
        self.owner = ""  # an adapter run: the peer id whose adapters they are (saved with them, checked on load)
        self.frozen_base = frozen_base or adapter is not None
        self.blocks = blocks if self.frozen_base else blocks.requires_grad_(True).train()
        self.accumulation = accumulation
        self.keep_activations = keep_activations
        self.max_pending = max_pending
        self.auto_step = auto_step  # step after ``accumulation`` backwards; else only when ``apply`` is called
        trainable = self.blocks.parameters() if not self.frozen_base else adapter.params() if adapter else []
        self.part = PartOptimizer(trainable, optim, guard=True)  # never commits NaN/inf weights
        self.version = 0  # bumped whenever the weights change (optimizer step or load)
        self.micro_count = 0  # backward passes since the last optimizer step
        self._pending: dict[str, _Saved] = {}
        self._lock = threading.Lock()
        self.staleness = 0  # 1: forwards may name the weights of the step before (``at_step``)
        self.versions = WeightVersions(self.part.params)

    @property
    def step(self) -> int:
        """Optimizer steps done."""
        return self.part.step_count

    @property
    def last_grad_norm(self) -> float | None:
        """Grad-norm of this stage's parameters before clipping, at the last optimizer step."""
        return self.part.last_grad_norm

    @property
    def pending(self) -> int:
        """Micro-batches forwarded here and not yet backwarded or dropped."""
        return len(self._pending)

    def pending_ids(self) -> set[str]:
        """The ids of the micro-batches forwarded here and not yet backwarded or dropped."""
        with self._lock:
            return set(self._pending)

    def _check_room(self, micro_id: str) -> None:
        """A new micro-batch ``micro_id`` may be kept (call with ``_lock`` held): a fresh id, below ``max_pending``."""
        if micro_id in self._pending:
            raise ValueError(f"micro-batch {micro_id!r} is already pending here: use a fresh id per micro-batch")
        if len(self._pending) >= self.max_pending:
            raise ValueError(f"{len(self._pending)} micro-batches are pending (max_pending={self.max_pending}): "
                             "backward or drop some before sending more")

    def _check_input(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> None:
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or not hidden.is_floating_point():
            got = getattr(hidden, "shape", hidden)
            raise ValueError(f"hidden must be a float tensor [batch, seq, hidden], got {got}")
        if not isinstance(position_ids, torch.Tensor) or tuple(position_ids.shape) != tuple(hidden.shape[:2]):
            raise ValueError(f"position_ids must be [batch, seq] = {tuple(hidden.shape[:2])}, "
                             f"got {getattr(position_ids, 'shape', position_ids)}")

    def _run(self, hidden: torch.Tensor, position_ids: torch.Tensor, *, grad: bool = True,
             weights: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks on a fresh input leaf (on ``weights``, a kept copy, if given); with ``grad`` the output carries
        the graph."""
        leaf = hidden.detach().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            if self.adapter is not None:
                with using(self.adapter.deltas(weights)):
                    out, _ = self.blocks(leaf, position_ids)
            elif weights is None:
                out, _ = self.blocks(leaf, position_ids)
            else:
                by_id = {id(p): w for p, w in zip(self.part.params, weights, strict=True)}
                out, _ = call_with(self.blocks, by_id, leaf, position_ids)
        return leaf, out

    def forward(self, micro_id: str, hidden: torch.Tensor, position_ids: torch.Tensor, *, at_step: int = -1
                ) -> torch.Tensor:
        """Run the blocks on ``hidden [B, T, H]``; remember the micro-batch for ``backward``; return the output.
        ``at_step`` >= 0 (staleness 1 only): on the weights of that step count (now or before the last step)."""
        self._check_input(hidden, position_ids)
        if at_step >= 0 and not self.staleness:
            raise ValueError(f"micro-batch {micro_id!r} names the weights of step {at_step}, but the run was opened "
                             "with staleness 0: open it with staleness=1 for asynchronous steps")
        with self._lock:
            self._check_room(micro_id)
            saved = _Saved(hidden.detach(), position_ids.detach())
            if at_step >= 0:
                saved.weights = self.versions.at(at_step, self.step)
            leaf, out = self._run(hidden, position_ids, grad=self.keep_activations, weights=saved.weights)
            if self.keep_activations:
                saved.leaf, saved.output, saved.version = leaf, out, self.version
            self._pending[micro_id] = saved
            return out.detach()

    def backward(self, micro_id: str, grad_output: torch.Tensor, *, hidden: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Gradient w.r.t. the stage input for ``micro_id``; adds parameter grads and steps when due.

        For a micro-batch not forwarded here, pass ``hidden`` and ``position_ids`` (stateless recompute).
        Raises ``GradientError`` (nothing applied, micro-batch dropped) for an unknown id or a bad gradient.
        """
        with self._lock:
            saved = self._pending.pop(micro_id, None)
            if saved is None:
                if hidden is None or position_ids is None:
                    raise GradientError(f"micro-batch {micro_id!r} is not pending here (never forwarded, or dropped): "
                                        "forward it again, or pass hidden= and position_ids= to recompute it")
                self._check_input(hidden, position_ids)
                saved = _Saved(hidden.detach(), position_ids.detach())
            self._check_grad(micro_id, grad_output, saved.hidden)
            grad_output = grad_output.to(saved.hidden.device)
            if saved.output is not None and (saved.version == self.version or saved.weights is not None):
                leaf, out = saved.leaf, saved.output  # (a kept copy of the weights never changes in place)
            else:
                leaf, out = self._run(saved.hidden, saved.position_ids, weights=saved.weights)
            params = self.part.params if saved.weights is None else saved.weights
            grads = torch.autograd.grad(out, [leaf, *params], grad_output, allow_unused=True)
            if not all_finite(grads):
                raise GradientError(f"micro-batch {micro_id!r} produced non-finite gradients; it was dropped and "
                                    "nothing was applied (check the loss scale and the incoming gradient)")
            self.part.add(grads[1:])
            self.micro_count += 1
            if self.auto_step and self.micro_count >= self.accumulation:
                self._optimizer_step()
            return grads[0]

    def _check_grad(self, micro_id: str, grad: torch.Tensor, hidden: torch.Tensor) -> None:
        if not isinstance(grad, torch.Tensor):
            raise GradientError(f"gradient for {micro_id!r} must be a tensor, got {type(grad).__name__}")
        if grad.shape != hidden.shape or grad.dtype != hidden.dtype:
            raise GradientError(f"gradient for {micro_id!r} has shape {tuple(grad.shape)} and dtype {grad.dtype}; "
                                f"this stage's output is {tuple(hidden.shape)} {hidden.dtype}")
        if not all_finite([grad]):
            raise GradientError(f"gradient for {micro_id!r} contains NaN or inf; the micro-batch was dropped")

    def _optimizer_step(self) -> None:
        before = self.step
        if self.staleness:  # micro-batches of the next step may still need the weights before this one
            self.versions.before_step(before)
        try:
            stepped = self.part.step()
        except NonFiniteStep as e:
            raise GradientError(f"blocks {self.blocks.start}:{self.blocks.end}: {e}; the step's gradients were "
                                "discarded (lower the lr, check the gradients; with float16 weights AdamW's eps "
                                "underflows: use bfloat16 or float32)") from None
        finally:
            self.micro_count = 0
            self.versions.after_step(before)
        if stepped:
            self.version += 1
            logger.debug("blocks [%d, %d): step %d, grad-norm %.4g", self.blocks.start, self.blocks.end,
                         self.step, self.last_grad_norm)

    def apply(self, expected: int) -> None:
        """Step now on the ``expected`` micro-batches accumulated since the last step (two-phase: the trainer
        says when its step is complete). A different count means part of the step was lost: its partial
        gradients are discarded and ``GradientError`` raised, so no stage applies half a step."""
        with self._lock:
            if self.micro_count != expected:
                got = self.micro_count
                self._pending.clear()
                self.part.zero_grad()
                self.micro_count = 0
                raise GradientError(f"this stage holds {got} micro-batch(es) of the step, not {expected}: the step's "
                                    "gradients were discarded (retry the step)")
            self._optimizer_step()

    def drop(self, micro_id: str) -> bool:
        """Forget a pending micro-batch; True if it was pending."""
        with self._lock:
            return self._pending.pop(micro_id, None) is not None

    def reset_accumulation(self) -> None:
        """Discard partial grads and pending micro-batches (e.g. the trainer left): no half-applied update."""
        with self._lock:
            self._pending.clear()
            self.part.zero_grad()
            self.micro_count = 0

    def save(self, directory: str | Path) -> Path:
        """Write weights + AdamW state as of the last optimizer step (partial grads are not saved)."""
        with self._lock:
            return save_stage_state(directory, self._saved_part(), self.part.optimizer, self.step,
                                    {**self._meta(), "optim": self.part.optim.to_dict()})

    def load(self, directory: str | Path) -> dict[str, Any]:
        """Restore weights, AdamW state and step from ``save``; drops pending micro-batches and partial grads."""
        with self._lock:
            info = load_stage_state(directory, self._saved_part(), self.part.optimizer, expect=self._meta())
            self._pending.clear()
            self.part.zero_grad()
            self.part.step_count = int(info["step"])
            self.micro_count = 0
            self.version += 1
            self.versions.clear()
            return info

    def _saved_part(self) -> torch.nn.Module:
        """What this run trains, and saves: the adapter, nothing (a frozen base with no adapter), or the blocks."""
        if self.adapter is not None:
            return self.adapter
        return torch.nn.Module() if self.frozen_base else self.blocks

    def _meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"kind": "stage", "start": self.blocks.start, "end": self.blocks.end}
        if self.adapter is not None:
            meta.update(kind="adapter", adapter=self.adapter.spec.text(), owner=self.owner)
        return meta

    def weights_replaced(self) -> None:
        """The weights were replaced without a step (a replica's parameters): graphs and the current copy are stale."""
        self.version += 1
        self.versions.replaced(self.step)
