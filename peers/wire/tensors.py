"""Tensors on the stream: serialized (bfloat16 kept at 2 bytes) or coded (``swarm.compression``: fp16, bf16, int8,
top-k), optionally sealed, split into chunk messages and read back with a size limit (on the bytes on the wire and
on the decoded tensor)."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any

import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import split_for_streaming

from peers.core.ids import DTYPES
from peers.wire.errors import RequestError
from swarm.compression.codecs import CODED, NONE, Codec, Encoded, decode, encode, serialize_none

MAX_REPLY_BYTES = 1 << 30  # clients accept replies up to this size
CHUNK_BYTES = 1 << 20  # tensors travel in 1 MiB messages: big enough for the stream rate, small for memory
WIRE_DTYPES = DTYPES  # what a peer accepts on the wire: the dtypes it can serve
MAX_DIMS = 8  # a tensor on the wire has at most this many dimensions (ours have 1 to 4)


def sealer(channel) -> Callable[[bytes, bytes], bytes] | None:
    """``seal(buffer, metadata)`` for ``tensor_messages`` from a stream's ``SecureChannel`` (None: plaintext).

    The request's metadata is the associated data, so a sealed tensor cannot be moved to another request.
    """
    return None if channel is None else (lambda data, aad: channel.seal(data, step=0, aad=aad))


def unsealer(channel) -> Callable[[bytes, bytes], bytes] | None:
    """The inverse of ``sealer``, for ``read_tensor_messages``."""
    return None if channel is None else (lambda data, aad: channel.open(data, step=0, aad=aad))


def serialize(tensor: torch.Tensor) -> runtime_pb2.Tensor:
    """hivemind's serialization, except that bfloat16 keeps its 2 bytes per value (hivemind's default mode
    widens it to float32, doubling the bytes of a bf16 model's activations); every hivemind reads both."""
    return serialize_none(tensor)


def tensor_messages(
    tensor: torch.Tensor | Encoded, metadata: bytes, cls: type = runtime_pb2.ExpertRequest,
    seal: Callable[[bytes, bytes], bytes] | None = None, codec: Codec = NONE, indices: torch.Tensor | None = None,
) -> Iterator[Any]:
    """Serialize ``tensor`` in ``codec`` (``indices``: top-k's forced pattern) into stream messages; the first one
    carries ``metadata``. An ``Encoded`` tensor (``swarm.compression.encode``) travels as it is.

    ``seal(buffer, metadata)``, if given, encrypts the coded bytes (shape, dtype and the coded mark stay in the
    clear; a codec's header is sealed with its data).
    """
    if isinstance(tensor, Encoded):
        serialized = runtime_pb2.Tensor()
        serialized.CopyFrom(tensor.serialized)
    else:
        serialized = encode(tensor, codec, indices=indices).serialized
    if seal is not None:
        serialized.buffer = seal(serialized.buffer, metadata)
    for i, chunk in enumerate(split_for_streaming(serialized, CHUNK_BYTES)):
        yield cls(tensors=[chunk], metadata=metadata if i == 0 else b"")


async def read_tensor_messages(
    stream: AsyncIterator[Any], max_bytes: int, first: Any | None = None,
    unseal: Callable[[bytes, bytes], bytes] | None = None,
) -> tuple[bytes, torch.Tensor]:
    """``read_coded_messages`` without the top-k indices."""
    metadata, tensor, _ = await read_coded_messages(stream, max_bytes, first, unseal)
    return metadata, tensor


async def read_coded_messages(
    stream: AsyncIterator[Any], max_bytes: int, first: Any | None = None,
    unseal: Callable[[bytes, bytes], bytes] | None = None, *, max_decoded_bytes: int | None = None,
    dtypes: Mapping[str, torch.dtype] = WIRE_DTYPES,
) -> tuple[bytes, torch.Tensor, torch.Tensor | None]:
    """Collect one tensor (the first message's metadata, the dense tensor, and for a top-k message its sorted flat
    indices, else None) from a stream of chunked messages, in any codec.

    ``first``, if given, is a message already taken from ``stream``. Reads exactly the tensor's chunks, so
    a long-lived stream can carry many tensors one after another. Raises ``RequestError`` if the stream
    ends early, the chunks are malformed or exceed ``max_bytes`` on the wire (or declare more chunks than
    ``max_bytes`` allows: a tensor is kept as its chunks' buffers only, never more of them), if the decoded tensor
    would exceed ``max_decoded_bytes`` (default ``max_bytes``: a codec saves bandwidth, it never raises what a peer
    takes), or its codec's data is malformed; ``unseal``'s error if it refuses. ``dtypes``: the uncompressed dtypes
    accepted (a graph's edges may also carry int64 and bool, ``peers.wire.edges``).
    """
    if first is None:
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            raise RequestError("stream ended before any tensor") from None
    if len(first.tensors) != 1:
        raise RequestError(f"expected one tensor per message, got {len(first.tensors)}")
    head = first.tensors[0]
    expected, most = max(1, head.chunks), max(1, -(-max_bytes // CHUNK_BYTES))
    buffers, received, count = [head.buffer], len(head.buffer) + len(first.metadata), 1
    while count < expected:  # an oversized tensor is still read to its end (and dropped): the stream stays in step
        try:
            message = await anext(stream)
        except StopAsyncIteration:
            raise RequestError(f"stream ended after {count} of {expected} chunks") from None
        if len(message.tensors) != 1:
            raise RequestError("malformed stream: a chunk message must carry exactly one tensor part")
        received += len(message.tensors[0].buffer) + len(message.metadata)
        count += 1
        if received <= max_bytes and expected <= most:
            buffers.append(message.tensors[0].buffer)
        else:
            buffers.clear()
    if received > max_bytes:
        raise RequestError(f"request exceeds this peer's limit of {max_bytes} bytes; send smaller batches")
    if expected > most:
        raise RequestError(f"tensor declares {expected} chunks; at most {most} fit this peer's limit of {max_bytes} B")
    serialized = runtime_pb2.Tensor(size=head.size, dtype=head.dtype, compression=head.compression,
                                    buffer=b"".join(buffers))
    if unseal is not None:
        serialized.buffer = unseal(serialized.buffer, first.metadata)
    if serialized.compression != CODED:
        return first.metadata, decode_tensor(serialized, dtypes), None
    try:
        decoded = decode(serialized, max_bytes=max_bytes if max_decoded_bytes is None else max_decoded_bytes)
    except ValueError as e:
        raise RequestError(str(e)) from None
    return first.metadata, decoded.tensor, decoded.indices


def decode_tensor(serialized: runtime_pb2.Tensor, dtypes: Mapping[str, torch.dtype] = WIRE_DTYPES) -> torch.Tensor:
    """An uncompressed (``none``) tensor of a wire dtype (one of ``dtypes``) whose buffer matches its shape (checked
    before anything is allocated; never requiring grad), else ``RequestError``."""
    if serialized.dtype not in dtypes:
        raise RequestError(f"dtype {serialized.dtype[:32]!r} is not accepted; send one of {sorted(dtypes)}")
    if serialized.compression != runtime_pb2.CompressionType.NONE:
        raise RequestError(f"malformed tensor: compression type {serialized.compression} is not accepted; "
                           f"send uncompressed (NONE) or coded tensors")
    if len(serialized.size) > MAX_DIMS:
        raise RequestError(f"malformed tensor: {len(serialized.size)} dimensions, at most {MAX_DIMS} accepted")
    numel = math.prod(serialized.size)
    legacy = {numel * 4} if serialized.dtype == "bfloat16" else set()  # hivemind's legacy bfloat16 mode sends fp32
    sizes = {numel * dtypes[serialized.dtype].itemsize, *legacy}
    if len(serialized.buffer) not in sizes:
        shape = tuple(serialized.size)
        raise RequestError(f"tensor of shape {shape} does not match its {len(serialized.buffer)} bytes")
    try:
        return deserialize_torch_tensor(serialized).detach()
    except Exception as e:
        raise RequestError(f"malformed tensor: {e}") from e
