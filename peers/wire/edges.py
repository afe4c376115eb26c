"""Multi-tensor cuts (issue 18, item 3): every tensor crossing a cut of an operator graph, named by its edge.

A bundle is one tensor per edge, in the stage's edge order, each sent as ``peers.wire.tensors`` sends a hidden
state (chunked, optionally coded and sealed, size-checked on arrival). Each tensor's metadata is an ``EdgeHeader``:
the graph's hash, the bundle's edge names, this tensor's index, and the enclosing request's bytes (``context``).
Sealing binds a tensor to its metadata (the AEAD's associated data), so a sealed tensor cannot be moved to another
edge, bundle or request. On arrival the receiver checks the hash (both traced the same graph), the names (the edges
its stage takes, in order) and each tensor's shape and dtype against its ``EdgeSpec``, and refuses with a message
saying what differs; the whole bundle is read before anything is refused, so the stream stays in step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from hivemind.proto import runtime_pb2

from peers.model.graph.trace import EdgeSpec
from peers.wire.errors import RequestError
from peers.wire.messages import Message
from peers.wire.tensors import WIRE_DTYPES, read_coded_messages, tensor_messages
from privacy.errors import ChannelError
from swarm.compression.codecs import NONE, Codec

EDGE_DTYPES: dict[str, torch.dtype] = {**WIRE_DTYPES, "int64": torch.int64, "bool": torch.bool}  # masks, indices
MAX_EDGES = 256  # tensors in one bundle (ResNet's cuts have 1 or 2; a transformer's graph a few)
EDGE_CODECS = ("none", "fp16", "bf16", "int8")


def edge_codec(text: str) -> Codec:
    """The codec a graph run's edges travel with (``GraphForward.compression``): "" or "none" (bit-exact), "fp16",
    "bf16" or "int8"; ``RequestError`` for anything else (top-k is refused: a stage's backward would need the forward's
    sparsity pattern, which graph stages do not keep)."""
    name = (text or "none").strip()
    if name not in EDGE_CODECS:
        raise RequestError(f"graph edges travel with one of {', '.join(EDGE_CODECS)}, not {text[:32]!r} (top-k is "
                           "for a chain's hidden states)")
    return Codec.parse(name)


@dataclasses.dataclass(frozen=True)
class EdgeHeader(Message):
    """The metadata of each tensor of a bundle."""

    graph_hash: str
    names: list[str]
    index: int
    context: bytes = b""


def check_edges(tensors: Mapping[str, Any], specs: Sequence[EdgeSpec], where: str = "this cut") -> None:
    """``ValueError`` unless ``tensors`` holds exactly the edges of ``specs``, each of its shape and dtype."""
    names = [s.name for s in specs]
    if set(tensors) != set(names):
        missing, extra = sorted(set(names) - set(tensors)), sorted(set(tensors) - set(names))
        raise ValueError(f"{where} carries edges {names}; missing {missing}, unexpected {extra}")
    for spec in specs:
        spec.check(tensors[spec.name])


def edge_messages(
    tensors: Mapping[str, torch.Tensor], specs: Sequence[EdgeSpec], graph_hash: str, *, context: bytes = b"",
    cls: type = runtime_pb2.ExpertRequest, seal: Callable[[bytes, bytes], bytes] | None = None, codec: Codec = NONE,
) -> Iterator[Any]:
    """The stream messages of one bundle: ``tensors`` checked against ``specs`` (``ValueError``), in their order.
    ``codec`` applies to floating-point edges; integer and bool edges (masks, indices) travel as they are."""
    check_edges(tensors, specs, "the bundle")
    if len(specs) > MAX_EDGES:
        raise ValueError(f"a bundle carries at most {MAX_EDGES} edges, got {len(specs)}")
    names = [s.name for s in specs]
    for i, spec in enumerate(specs):
        header = EdgeHeader(graph_hash, names, i, context).to_bytes()
        tensor = tensors[spec.name]
        yield from tensor_messages(tensor, header, cls, seal, codec if tensor.is_floating_point() else NONE)


async def _next(stream: AsyncIterator[Any], got: int, count: int) -> Any:
    try:
        return await anext(stream)
    except StopAsyncIteration:
        raise RequestError(f"stream ended after {got} of the bundle's {count} tensors") from None


async def read_edge_messages(
    stream: AsyncIterator[Any], specs: Sequence[EdgeSpec], graph_hash: str, max_bytes: int, *,
    first: Any | None = None, unseal: Callable[[bytes, bytes], bytes] | None = None,
) -> tuple[dict[str, torch.Tensor], bytes]:
    """Read one bundle (``max_bytes`` for all its tensors together) and check it against ``specs``: the tensors by
    edge name and the context. ``RequestError`` saying what differs, after the whole bundle was read."""
    tensors: list[torch.Tensor] = []
    headers: list[EdgeHeader] = []
    count, budget, problem, refusal = 1, max_bytes, "", None
    while len(headers) < count:
        i = len(headers)
        message = first if first is not None and i == 0 else await _next(stream, i, count)
        try:
            header = EdgeHeader.from_bytes(message.metadata)
        except ValueError as e:
            if i == 0:  # no count to read on by
                raise RequestError(f"malformed edge bundle: {e}") from None
            problem, header = problem or f"tensor {i}'s header: {e}", headers[0]
        if i == 0:
            count = len(header.names)
            if not 1 <= count <= MAX_EDGES:
                raise RequestError(f"an edge bundle carries 1 to {MAX_EDGES} edges, this one says {count}")
        elif (header.graph_hash, header.names, header.context) != (headers[0].graph_hash, headers[0].names,
                                                                   headers[0].context):
            problem = problem or f"tensor {i} of the bundle belongs to another bundle"
        if header.index != i:
            problem = problem or f"tensor {i} of the bundle says it is edge {header.index}"
        headers.append(header)
        try:  # a refused tensor is still read to its end, and the rest of the bundle after it
            _, tensor, _ = await read_coded_messages(stream, budget, message, unseal, dtypes=EDGE_DTYPES)
        except (RequestError, ChannelError) as e:  # too big, malformed, or a sealed tensor that does not open
            refusal = refusal or e
            continue
        tensors.append(tensor)
        budget -= tensor.numel() * tensor.element_size()
    if refusal is not None:
        raise refusal
    if problem:
        raise RequestError(f"malformed edge bundle: {problem}")
    head = headers[0]
    if head.graph_hash != graph_hash:
        raise RequestError(f"graph hash mismatch: the sender traced {head.graph_hash[:16]}, this peer "
                           f"{graph_hash[:16]}; both must trace the same architecture, config and input shape")
    received = dict(zip(head.names, tensors, strict=True))
    if len(received) != len(tensors):
        raise RequestError(f"malformed edge bundle: edge names repeat in {head.names}")
    try:
        check_edges(received, specs, "this stage's cut")
    except ValueError as e:
        raise RequestError(str(e)) from None
    return {s.name: received[s.name] for s in specs}, head.context
