"""Replicas of a graph stage (peers serving the same nodes in one run): what they average and how a new one starts
from another's weights.

Replicas average their parameters and floating-point buffers (BatchNorm's running statistics) with
``peers.server.averaging.ReplicaAverager``, exactly as transformer replicas do, every ``average_every`` steps; the
integer buffers (BatchNorm's batch counters) stay each replica's own. A replica joining a run that is new to it
first copies the current weights and buffers of the replica the trainer names (``GraphOpen.source``), so that the
replicas start equal; its optimizer starts fresh.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import torch

from peers.model.graph.trace import EdgeSpec
from peers.wire.errors import RequestError
from peers.wire.messages import GraphFetch
from privacy.peer_ids import short_id

MAX_REPLICAS = 16  # other replicas one run may name for a stage
StreamFor = Callable[[str], Awaitable]  # peer id -> an open PeerStream to it


def averaged(module: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors replicas average, in a fixed order: every parameter, then every floating-point buffer."""
    return [*module.parameters(), *(b for b in module.buffers() if b.is_floating_point())]


def flat_state(module: torch.nn.Module) -> torch.Tensor:
    """``averaged(module)`` as one flat fp32 tensor."""
    tensors = averaged(module)
    if not tensors:
        return torch.zeros(0)
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])


def numel(module: torch.nn.Module) -> int:
    return sum(t.numel() for t in averaged(module))


def load_flat(module: torch.nn.Module, flat: torch.Tensor) -> None:
    """Write ``flat`` (as ``flat_state`` made it) back into the module's tensors."""
    tensors = averaged(module)
    if flat.numel() != sum(t.numel() for t in tensors):
        raise ValueError(f"{flat.numel()} values for a stage of {sum(t.numel() for t in tensors)}")
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t).to(t.dtype))
            offset += t.numel()


def check_replicas(replicas: list[str], own: str, source: str, average_every: int) -> None:
    """``RequestError`` for a bad replica list, source or averaging period."""
    if len(replicas) > MAX_REPLICAS or not all(isinstance(p, str) and 0 < len(p) <= 128 for p in replicas):
        raise RequestError(f"a run names at most {MAX_REPLICAS} other replicas of a stage, by peer id")
    if not 1 <= average_every <= 1 << 20:
        raise RequestError(f"average_every must be in 1..{1 << 20}, got {average_every}")
    if source and (source == own or source not in replicas):
        raise RequestError(f"the source of the weights ({short_id(source)}) must be another replica the run names")


async def copy_from(source: str, stream_for: StreamFor, module: torch.nn.Module, graph_hash: str,
                    timeout: float) -> int:
    """Load ``source``'s current parameters and buffers (a ``GraphFetch`` of the same graph) into ``module``;
    its step. ``RequestError`` saying why if it cannot be reached or sends something else."""
    state = module.state_dict()
    specs = [EdgeSpec(k, tuple(v.shape), v.dtype) for k, v in state.items()]
    try:
        stream = await stream_for(source)
        reply, got = await stream.submit_bundle(GraphFetch(graph_hash=graph_hash), None, (), specs, graph_hash,
                                                timeout)
    except Exception as e:
        raise RequestError(f"could not copy the weights of replica {short_id(source)}: {e}") from None
    if got is None or set(got) != set(state):
        raise RequestError(f"replica {short_id(source)} sent another stage's state")
    if not all(torch.isfinite(v).all() for v in got.values() if v.is_floating_point()):
        raise RequestError(f"replica {short_id(source)} sent NaN or infinite weights")
    module.load_state_dict(got)
    return reply.step
