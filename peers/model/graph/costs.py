"""What the graph cut planner needs from a traced graph: each node's FLOPs and bytes moved, each cut's bytes.

FLOPs are counted, not timed: one pass of the example through the graph under ``torch.utils.flop_counter``
(matmuls, convolutions, attention; elementwise ops count 0 FLOPs there), and each node's bytes moved are its
tensor inputs' and output's sizes (what bounds BatchNorm, ReLU, adds). A peer's time for a node is then
``flops / its FLOP/s + bytes / its memory bandwidth`` (``swarm.plan.graph_cut.node_seconds_from_work``):
deterministic, the same on every machine that plans, with no noisy timing of 175 tiny ops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils.flop_counter import FlopCounterMode

from .trace import OpGraph


@dataclass(frozen=True)
class GraphCosts:
    """Per node of ``order``: FLOPs and bytes moved; per cut ``0..n``: bytes crossing and whether it may be cut."""

    flops: tuple[float, ...]
    bytes_moved: tuple[float, ...]
    cut_bytes: tuple[float, ...]
    allowed: tuple[bool, ...]
    param_bytes: tuple[float, ...] = ()  # per node: parameters and buffers it holds (a shared one at its first use)


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def graph_costs(graph: OpGraph, example_inputs: Sequence[torch.Tensor]) -> GraphCosts:
    """Count each node's FLOPs and bytes on ``example_inputs`` (the graph's modules and buffers are left as they
    were: BatchNorm statistics are restored) and each cut's crossing bytes from the traced edge specs."""
    position = graph.position
    flops = [0.0] * len(graph.order)
    moved = [0.0] * len(graph.order)

    class _Counter(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            if n.name not in position or position[n.name] < 0:
                return super().run_node(n)
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            counter = FlopCounterMode(display=False)
            with counter:
                result = getattr(self, n.op)(n.target, args, kwargs)
            i = position[n.name]
            flops[i] = float(counter.get_total_flops())
            moved[i] = float(_nbytes(list(args)) + _nbytes(list(kwargs.values())) + _nbytes(result))
            return result

    buffers = {name: b.clone() for name, b in graph.gm.named_buffers()}
    with torch.no_grad():
        _Counter(graph.gm).run(*example_inputs)
        for name, b in graph.gm.named_buffers():
            b.copy_(buffers[name])
    n = len(graph.order)
    cut_bytes = [0.0] * (n + 1)
    for name, last in graph.last_use.items():
        spec = graph.values.get(name)
        for c in range(position[name] + 1, last + 1):
            cut_bytes[c] += spec.nbytes if spec is not None else 0.0
    allowed = tuple(graph.cuttable(c) for c in range(n + 1))
    return GraphCosts(tuple(flops), tuple(moved), tuple(cut_bytes), allowed, _param_bytes(graph))


def _param_bytes(graph: OpGraph) -> tuple[float, ...]:
    nodes = {node.name: node for node in graph.gm.graph.nodes}
    seen: set[int] = set()
    held = []
    for name in graph.order:
        node, total = nodes[name], 0
        tensors: list[torch.Tensor] = []
        if node.op == "call_module":
            module = graph.gm.get_submodule(str(node.target))
            tensors += [*module.parameters(), *module.buffers()]
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                obj: Any = graph.gm
                for part in str(arg.target).split("."):
                    obj = getattr(obj, part)
                if isinstance(obj, torch.Tensor):
                    tensors.append(obj)
        for t in tensors:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        held.append(float(total))
    return tuple(held)
