"""``graph_hash``: a digest of a traced graph's structure, equal in every process that traces the same model.

It covers each node's kind, target (an ATen overload, a function's qualified name, or a leaf module's class and
``extra_repr``, e.g. a conv's kernel and stride), its arguments with other nodes as references by position, and
every parameter's and buffer's name, shape and dtype. Not the weights' values (a run names its weights folder),
nor names of nodes (positions are used), nor memory addresses.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch import fx

from .trace import OpGraph


def _target(gm: fx.GraphModule, node: fx.Node) -> str:
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        return f"{type(module).__module__}.{type(module).__qualname__}({module.extra_repr()})"
    if node.op in ("placeholder", "output", "call_method", "get_attr"):
        return str(node.target) if node.op != "placeholder" else ""
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    return f"{module}.{getattr(target, '__qualname__', getattr(target, '__name__', repr(target)))}"


def _arg(value: Any, index: dict[str, int]) -> Any:
    if isinstance(value, fx.Node):
        return ["node", index[value.name]]
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [_arg(v, index) for v in value]]
    if isinstance(value, dict):
        return ["dict", [[str(k), _arg(v, index)] for k, v in value.items()]]
    if isinstance(value, slice):
        return ["slice", [_arg(value.start, index), _arg(value.stop, index), _arg(value.step, index)]]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return ["float", repr(value)]
    if isinstance(value, torch.Tensor):
        return ["tensor", list(value.shape), str(value.dtype)]
    return [type(value).__name__, str(value)]  # dtype, device, memory_format, layout...


def graph_structure(graph: OpGraph) -> dict[str, Any]:
    """The JSON-able structure ``graph_hash`` digests (useful to diff two graphs whose hashes differ)."""
    gm = graph.gm
    index = {node.name: i for i, node in enumerate(gm.graph.nodes)}
    nodes = [[node.op, _target(gm, node), _arg(node.args, index), _arg(node.kwargs, index)] for node in gm.graph.nodes]
    state = [[name, list(t.shape), str(t.dtype)] for name, t in gm.state_dict(keep_vars=True).items()]
    return {"arch": graph.arch, "tracer": graph.tracer, "nodes": nodes, "state": state}


def graph_hash(graph: OpGraph) -> str:
    """SHA-256 (hex) of ``graph_structure(graph)``."""
    blob = json.dumps(graph_structure(graph), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()
