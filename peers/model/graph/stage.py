"""``GraphStage``: a contiguous slice ``[start, end)`` of an ``OpGraph``'s order as a module.

It takes the edges crossing the cut at ``start`` and returns those crossing ``end`` (for the last stage: the
graph's outputs), by name: ``stage({"maxpool": t, ...}) -> {"layer2_0_relu": u, ...}``. Skip connections that
span the stage pass through it. The stage holds only the submodules and attributes its nodes use, under the
model's own names (``layer3.0.conv1.weight``), so its ``state_dict`` is a slice of the model's.

Train and eval: fx graphs call the model's modules, so ``train()``/``eval()`` work as on the model (a BatchNorm in
train mode normalises with the micro-batch's statistics and moves its running stats, which live in exactly one
stage, as in one process); export graphs are fixed in the mode they were traced in.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping

import torch
from torch import fx, nn

from .trace import EdgeSpec, OpGraph

logger = logging.getLogger(__name__)


def _mutates_input(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` writes into its input (``ReLU(inplace=True)``, ``aten.add_``, ``x.add_()``...)."""
    if node.op == "call_module":
        return bool(getattr(gm.get_submodule(str(node.target)), "inplace", False))
    if node.kwargs.get("inplace"):
        return True
    if isinstance(node.target, torch._ops.OpOverload):
        return bool(node.target._schema.is_mutable)
    name = str(node.target) if node.op == "call_method" else getattr(node.target, "__name__", "")
    return node.op in ("call_function", "call_method") and name.endswith("_") and not name.startswith("_")


class GraphStage(nn.Module):
    """Nodes ``order[start:end]`` of ``graph``; ``inputs``/``outputs`` are the edge specs at either cut."""

    def __init__(self, graph: OpGraph, start: int, end: int, *, own: bool = True) -> None:
        super().__init__()
        if not 0 <= start < end <= len(graph.order):
            raise ValueError(f"stage [{start}, {end}) is not a non-empty range of the graph's {len(graph.order)} nodes")
        for cut in (start, end):
            if not graph.cuttable(cut):
                raise ValueError(f"cannot cut {graph.arch} at {cut}: a value crossing it is not a tensor "
                                 f"({[n for n in graph.crossing(cut) if graph.values[n] is None]})")
        self.arch, self.start, self.end = graph.arch, start, end
        self.inputs: tuple[EdgeSpec, ...] = graph.specs(graph.crossing(start))
        self.outputs: tuple[EdgeSpec, ...] = graph.specs(graph.crossing(end))
        nodes = {node.name: node for node in graph.gm.graph.nodes}
        sub = fx.Graph()
        env: dict[fx.Node, fx.Node] = {nodes[spec.name]: sub.placeholder(spec.name) for spec in self.inputs}
        mutated: set[str] = set()
        for name in graph.order[start:end]:
            node = nodes[name]
            for arg in node.all_input_nodes:
                if arg.op == "get_attr" and arg not in env:
                    env[arg] = sub.node_copy(arg)
                if _mutates_input(graph.gm, node) and arg.name in graph.position and graph.position[arg.name] < start:
                    mutated.add(arg.name)
            env[node] = sub.node_copy(node, lambda n: env[n])
        sub.output({spec.name: env[nodes[spec.name]] for spec in self.outputs})
        sub.lint()
        module = fx.GraphModule(graph.gm, sub, class_name=f"GraphStage_{start}_{end}")
        self.module = copy.deepcopy(module) if own else module
        self.module.train(graph.gm.training)
        self._clone = frozenset(mutated)  # inputs an in-place op writes into: cloned, so the caller's stay intact

    def forward(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the slice on ``inputs`` (every input edge by name); ``ValueError`` on a missing, extra or wrong edge."""
        self.check_inputs(inputs)
        args = [inputs[s.name].clone() if s.name in self._clone else inputs[s.name] for s in self.inputs]
        out: dict[str, torch.Tensor] = self.module(*args)
        return out

    def check_inputs(self, inputs: Mapping[str, torch.Tensor]) -> None:
        names = [s.name for s in self.inputs]
        if set(inputs) != set(names):
            missing, extra = sorted(set(names) - set(inputs)), sorted(set(inputs) - set(names))
            raise ValueError(f"stage [{self.start}, {self.end}) of {self.arch} takes edges {names}; "
                             f"missing {missing}, unexpected {extra}")
        for spec in self.inputs:
            spec.check(inputs[spec.name])

    def extra_repr(self) -> str:
        return f"arch={self.arch}, nodes=[{self.start}, {self.end}), in={len(self.inputs)}, out={len(self.outputs)}"


def split_graph(graph: OpGraph, cuts: list[int], *, own: bool = True) -> list[GraphStage]:
    """Stages between consecutive cuts ``0 < c1 < ... < len(order)`` (the cuts exclude 0 and the end)."""
    bounds = [0, *cuts, len(graph.order)]
    if any(a >= b for a, b in zip(bounds, bounds[1:], strict=False)):
        raise ValueError(f"cuts {cuts} must increase strictly within 1..{len(graph.order) - 1}")
    return [GraphStage(graph, a, b, own=own) for a, b in zip(bounds, bounds[1:], strict=False)]


def _tensors_used(graph: OpGraph, start: int, end: int) -> dict[int, str]:
    """id -> name of every parameter and buffer the nodes ``order[start:end]`` use."""
    nodes = {node.name: node for node in graph.gm.graph.nodes}
    used: dict[int, str] = {}
    for name in graph.order[start:end]:
        node = nodes[name]
        if node.op == "call_module":
            module = graph.gm.get_submodule(str(node.target))
            for key, t in [*module.named_parameters(), *module.named_buffers()]:
                used.setdefault(id(t), f"{node.target}.{key}")
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                obj: object = graph.gm
                for part in str(arg.target).split("."):
                    obj = getattr(obj, part)
                used.setdefault(id(obj), str(arg.target))
    return used


def shared_parameters(graph: OpGraph, cuts: list[int]) -> list[dict[int, str]]:
    """Parameters/buffers that nodes of more than one stage use (tied weights, e.g. GPT-2's ``wte`` and
    ``lm_head``): for each, the stages using it and the name each holds it under. Each stage holds its own copy, so
    training keeps them equal by summing their gradients across those stages (``sum_shared_grads``) before each
    stage's optimizer step; inference needs nothing."""
    bounds = [0, *cuts, len(graph.order)]
    holders: dict[int, dict[int, str]] = {}
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        for key, name in _tensors_used(graph, a, b).items():
            holders.setdefault(key, {})[i] = name
    return [names for names in holders.values() if len(names) > 1]


def sum_shared_grads(stages: list[GraphStage], shared: list[dict[int, str]]) -> None:
    """Give every copy of a shared parameter the sum of the copies' gradients, added from the last stage to the
    first (backward's order: one process adds them in the order its backward reaches the uses). In one process;
    across peers the stages holding a copy exchange these gradients instead."""
    for names in shared:
        grads = [stages[i].module.get_parameter(name).grad for i, name in sorted(names.items(), reverse=True)]
        present = [g for g in grads if g is not None]
        if not present:
            continue
        total = present[0].clone()
        for g in present[1:]:
            total += g
        for i, name in names.items():
            stages[i].module.get_parameter(name).grad = total.clone()
