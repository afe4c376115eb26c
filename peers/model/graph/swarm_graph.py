"""A graph as the swarm names it: what every peer and the trainer trace (``GraphSpec``), the DHT model name that
carries its architecture and a short hash, and where its stages are cut (the planner's cut or an equal split)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarm.plan.graph_cut import equal_split, node_seconds_from_work, plan_graph_cut

from .costs import graph_costs
from .hashing import graph_hash
from .registry import get_architecture, trace_architecture
from .trace import OpGraph

SPLITS = ("plan", "equal")
PLAN_PEER = (1e12, 40e9)  # the planner's peer when none is measured: FLOP/s and memory bytes/s (only ratios matter)
PLAN_LINK = 1e9 / 8  # bytes/s of each link between stages (1 Gbit/s)


@dataclass(frozen=True)
class GraphSpec:
    """An architecture, its config and input shape, an optional weights folder and the seed of a random init."""

    arch: str
    config: dict[str, Any] = field(default_factory=dict)
    inputs: dict[str, Any] = field(default_factory=dict)
    weights: Path | None = None
    seed: int = 0

    def trace(self) -> OpGraph:
        """Build and trace it here (``ValueError`` for an unknown architecture or a bad config)."""
        return trace_architecture(self.arch, self.config, self.inputs, self.weights, seed=self.seed)

    def example_inputs(self) -> tuple:
        return get_architecture(self.arch).example_inputs(self.inputs)


def swarm_model_name(graph: OpGraph, digest: str | None = None) -> str:
    """The name its peers announce under: ``resnet50-1a2b3c4d5e6f`` (architecture and the hash's first 12 digits), so
    that only peers that traced the same graph meet."""
    return f"{graph.arch}-{(digest or graph_hash(graph))[:12]}"


def stage_cuts(graph: OpGraph, stages: int, split: str = "plan", example_inputs: tuple | None = None,
               links: tuple[float, ...] | None = None) -> list[int]:
    """The inner cuts of ``stages`` stages: ``plan`` (``swarm.plan.graph_cut`` on counted FLOPs and bytes, equal
    peers; ``links``: bytes/s of the link into each stage after the first, default 1 Gbit/s each) or ``equal``
    (about as many nodes each)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    if links is not None and (len(links) != stages - 1 or min(links, default=1.0) <= 0):
        raise ValueError(f"{stages} stages need {stages - 1} positive link rates, got {list(links)}")
    n = len(graph.order)
    allowed = [graph.cuttable(c) for c in range(n + 1)]
    if split == "equal" or stages == 1:
        return equal_split(n, stages, allowed)
    if example_inputs is None:
        raise ValueError("the planner needs the graph's example inputs to count its costs")
    costs = graph_costs(graph, example_inputs)
    seconds = node_seconds_from_work(costs.flops, costs.bytes_moved, [PLAN_PEER] * stages)
    rates = list(links) if links is not None else [PLAN_LINK] * (stages - 1)
    return list(plan_graph_cut(seconds, costs.cut_bytes, rates, costs.allowed).cuts)


def stage_nodes(graph: OpGraph, index: int, stages: int, split: str = "plan",
                example_inputs: tuple | None = None, links: tuple[float, ...] | None = None) -> tuple[int, int]:
    """Nodes ``[start, end)`` of stage ``index`` of ``stages``."""
    if not 0 <= index < stages:
        raise ValueError(f"stage {index}/{stages}: need 0 <= INDEX < COUNT")
    bounds = [0, *stage_cuts(graph, stages, split, example_inputs, links), len(graph.order)]
    return bounds[index], bounds[index + 1]
