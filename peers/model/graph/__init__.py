"""Operator graphs (FusionLLM's OP-DAG): registered architectures traced locally, cut anywhere into stages.

Files:
    resnet.py    our ResNet with torchvision's module structure and state_dict keys.
    registry.py  ``ARCHITECTURES``, ``build_model``, ``trace_architecture``: what a peer may build and trace.
    trace.py     ``OpGraph`` (fx graph module, topological order, edge specs) and ``trace``; ``crossing(cut)``.
    hashing.py   ``graph_hash``: the structure's digest, compared between the trainer and every peer.
    stage.py     ``GraphStage``: a contiguous slice of the order as a module, named edges in and out.
    autodiff.py  ``train_forward`` / ``train_backward``: a stage's part of remote autodiff, gradients by edge.
    costs.py     per-node FLOPs and bytes, per-cut bytes: the planner's inputs.
"""

from .autodiff import Saved, train_backward, train_forward
from .costs import GraphCosts, graph_costs
from .hashing import graph_hash, graph_structure
from .registry import (
    ARCHITECTURES,
    Architecture,
    build_model,
    check_graph_hash,
    get_architecture,
    trace_architecture,
)
from .resnet import ResNet, resnet
from .stage import GraphStage, shared_parameters, split_graph, sum_shared_grads
from .trace import EdgeSpec, OpGraph, trace

__all__ = [
    "Saved", "train_backward", "train_forward",
    "GraphCosts", "graph_costs",
    "graph_hash", "graph_structure",
    "ARCHITECTURES", "Architecture", "build_model", "check_graph_hash", "get_architecture", "trace_architecture",
    "ResNet", "resnet",
    "GraphStage", "shared_parameters", "split_graph", "sum_shared_grads",
    "EdgeSpec", "OpGraph", "trace",
]
