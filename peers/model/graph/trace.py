"""``OpGraph``: a model traced into an operator graph, with a topological order and a spec for every edge.

Two tracers, both run locally on each peer from a registered builder (``registry``), never on a graph received:
- ``torch.fx.symbolic_trace`` for modules written without data-dependent Python control flow (our ResNet,
  torchvision's): nodes call the model's own leaf modules (``conv``, ``BatchNorm2d``), so ``train()``/``eval()``
  keep their meaning and parameter names are the model's ``state_dict`` keys.
- ``torch.export`` for code fx cannot trace (transformers' GPT-2: its ``forward`` takes ``**kwargs`` and builds
  masks with data-dependent branches). The graph is ATen ops specialised to the example shapes and to the
  module's mode at trace time (dropout off in ``eval``); parameters are ``get_attr`` nodes under the wrapper.

Edges are named by their producing node. A cut at position ``c`` of ``order`` (``0 <= c <= len(order)``) is
crossed by every value produced before ``c`` (graph inputs count as produced at ``-1``) and used at or after
``c`` (the graph's outputs count as used at ``len(order)``): skip connections cross every cut they span.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

logger = logging.getLogger(__name__)

TRACERS = ("fx", "export")
_DROPPED_TARGETS = ("aten._assert_tensor_metadata.default",)  # checks with no value, which pin inputs to a stage


@dataclass(frozen=True)
class EdgeSpec:
    """A tensor crossing a cut: its edge name (the producing node), shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * torch.empty((), dtype=self.dtype).element_size()

    def check(self, tensor: Any) -> None:
        """``ValueError`` unless ``tensor`` is a tensor of exactly this shape and dtype."""
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"edge {self.name!r} expects a tensor, got {type(tensor).__name__}")
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
            raise ValueError(f"edge {self.name!r} expects {list(self.shape)} {self.dtype}, "
                             f"got {list(tensor.shape)} {tensor.dtype}")


@dataclass
class OpGraph:
    """A traced graph module and what cutting it needs. ``values[name]`` is ``None`` for a non-tensor value."""

    arch: str
    tracer: str
    gm: fx.GraphModule
    order: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    values: dict[str, EdgeSpec | None]
    position: dict[str, int] = field(default_factory=dict)  # producing position; -1 for graph inputs
    last_use: dict[str, int] = field(default_factory=dict)  # last consuming position; len(order) for outputs

    def __post_init__(self) -> None:
        n = len(self.order)
        self.position = {name: -1 for name in self.inputs} | {name: i for i, name in enumerate(self.order)}
        nodes = {node.name: node for node in self.gm.graph.nodes}
        self.last_use = {}
        for name in self.position:
            users = [self.position[u.name] for u in nodes[name].users if u.op != "output"]
            if name in self.outputs:
                users.append(n)
            if users:
                self.last_use[name] = max(users)

    def crossing(self, cut: int) -> tuple[str, ...]:
        """Edges crossing a cut before position ``cut``, in producing order."""
        if not 0 <= cut <= len(self.order):
            raise ValueError(f"cut {cut} outside 0..{len(self.order)}")
        return tuple(name for name, pos in self.position.items()
                     if pos < cut and self.last_use.get(name, -2) >= cut)

    def cuttable(self, cut: int) -> bool:
        """Whether every value crossing ``cut`` is a tensor (a tuple from ``split`` cannot travel as an edge)."""
        return all(self.values[name] is not None for name in self.crossing(cut))

    def specs(self, names: Sequence[str]) -> tuple[EdgeSpec, ...]:
        out = []
        for name in names:
            spec = self.values[name]
            if spec is None:
                raise ValueError(f"edge {name!r} is not a tensor")
            out.append(spec)
        return tuple(out)


def _output_names(gm: fx.GraphModule) -> tuple[str, ...]:
    out: list[str] = []

    def note(n: fx.Node) -> fx.Node:
        out.append(n.name)
        return n

    for node in gm.graph.nodes:
        if node.op == "output":
            fx.node.map_arg(node.args, note)
    return tuple(dict.fromkeys(out))


def _record_values(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> dict[str, EdgeSpec | None]:
    values: dict[str, EdgeSpec | None] = {}

    class _Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            result = super().run_node(n)
            is_tensor = isinstance(result, torch.Tensor)
            values[n.name] = EdgeSpec(n.name, tuple(result.shape), result.dtype) if is_tensor else None
            return result

    buffers = {name: b.clone() for name, b in gm.named_buffers()}  # a BatchNorm in train mode would move its stats
    with torch.no_grad():
        _Recorder(gm).run(*example_inputs)
        for name, b in gm.named_buffers():
            b.copy_(buffers[name])
    return values


def _strip_export_checks(gm: fx.GraphModule) -> None:
    for node in reversed(list(gm.graph.nodes)):
        if (node.op == "call_module" and node.target == "_guards_fn") or str(node.target) in _DROPPED_TARGETS:
            gm.graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    gm.graph.lint()
    gm.recompile()


def trace(model: nn.Module, example_inputs: Sequence[torch.Tensor], *, tracer: str, arch: str = "") -> OpGraph:
    """Trace ``model`` (in its current train/eval mode) into an ``OpGraph`` with edge specs from the example."""
    if tracer == "fx":
        gm = fx.symbolic_trace(model)
    elif tracer == "export":
        gm = torch.export.export(model, tuple(example_inputs)).module()
        _strip_export_checks(gm)
    else:
        raise ValueError(f"unknown tracer {tracer!r}; expected one of {TRACERS}")
    if tracer == "fx":
        gm.train(model.training)
    inputs = tuple(n.name for n in gm.graph.nodes if n.op == "placeholder")
    if len(inputs) != len(example_inputs):
        raise ValueError(f"{arch or type(model).__name__} takes {len(inputs)} inputs {inputs}, "
                         f"got {len(example_inputs)} example inputs")
    order = tuple(n.name for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module"))
    values = _record_values(gm, example_inputs)
    graph = OpGraph(arch, tracer, gm, order, inputs, _output_names(gm), values)
    logger.debug("traced %s with %s: %d nodes, %d inputs, %d outputs", arch, tracer, len(order), len(inputs),
                 len(graph.outputs))
    return graph
