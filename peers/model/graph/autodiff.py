"""Remote automatic differentiation of one ``GraphStage``: a forward that keeps what its backward needs, and a
backward from the gradients of its output edges to those of its input edges, all by edge name.

A stage's peer runs ``train_forward`` on the edges it received (each a fresh leaf, as if computed elsewhere) and
sends the outputs on; when the gradients of its outputs come back, ``train_backward`` accumulates its parameters'
gradients and returns the gradients of its inputs, to send upstream. A gradient for an edge the stage does not
output, or not of the edge's shape and dtype, or NaN/infinite, is refused (``ValueError``) before anything is
accumulated. Outputs without a gradient (an edge that did not reach the loss, a mask) are skipped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .stage import GraphStage


@dataclass
class Saved:
    """What a stage keeps of one micro-batch between its forward and its backward."""

    inputs: dict[str, torch.Tensor]  # leaves; their .grad are the input edges' gradients
    outputs: dict[str, torch.Tensor]  # attached to the stage's autograd graph


def train_forward(stage: GraphStage, inputs: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Saved]:
    """The stage's outputs (detached, to send on) and what ``train_backward`` needs."""
    leaves = {k: v.detach().requires_grad_(v.is_floating_point()) for k, v in inputs.items()}
    with torch.enable_grad():
        outputs = stage(leaves)
    return {k: v.detach() for k, v in outputs.items()}, Saved(leaves, outputs)


def train_backward(stage: GraphStage, saved: Saved, grads: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Accumulate the parameters' gradients for ``grads`` of output edges; return the input edges' gradients."""
    differentiable = [s for s in stage.outputs if saved.outputs[s.name].requires_grad]
    known = {s.name for s in differentiable}
    unknown = sorted(set(grads) - known)
    if unknown:
        raise ValueError(f"stage [{stage.start}, {stage.end}) of {stage.arch} has no gradient to take for edges "
                         f"{unknown}; its differentiable outputs are {sorted(known)}")
    for spec in differentiable:
        if spec.name in grads:
            spec.check(grads[spec.name])
            if not torch.isfinite(grads[spec.name]).all():
                raise ValueError(f"the gradient of edge {spec.name!r} holds NaN or infinite values")
    names = [s.name for s in differentiable if s.name in grads]
    if names:
        torch.autograd.backward([saved.outputs[k] for k in names], [grads[k] for k in names])
    return {k: leaf.grad for k, leaf in saved.inputs.items() if leaf.grad is not None}
