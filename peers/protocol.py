"""Messages and RPC signatures shared by the stage server and its clients.

Each RPC is declared once, here, on ``StageService``; ``peers.handler.StageHandler`` implements it and
clients call ``StageService.get_stub(p2p, peer_id)``. Metadata are typed dataclasses packed with msgpack
and checked field by field on arrival; tensors travel as hivemind-serialized chunks of a stream.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any, AsyncIterator, ClassVar, TypeVar, get_type_hints  # noqa: UP035  hivemind needs typing's

import msgpack
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2PContext, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import split_for_streaming

from peers.wire_values import Mismatch, conform, type_name, unpack_map
from privacy.errors import MembershipError

MAX_REPLY_BYTES = 1 << 30  # clients accept replies up to this size
CHUNK_BYTES = 1 << 20  # tensors travel in 1 MiB messages: big enough for the stream rate, small for memory
WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MAX_DIMS = 8  # a tensor on the wire has at most this many dimensions (ours have 1 to 4)

M = TypeVar("M", bound="Message")


class Message:
    """A dataclass that packs to msgpack bytes and checks every field's type when unpacked (``ValueError`` if
    malformed; lists element by element, see ``peers.wire_values``)."""

    _fields: ClassVar[dict[type, list[tuple[str, Any, bool]]]] = {}  # per class: (name, type, required)

    @classmethod
    def _schema(cls) -> list[tuple[str, Any, bool]]:
        schema = Message._fields.get(cls)
        if schema is None:  # get_type_hints is slow: once per class, not per message
            hints = get_type_hints(cls)
            schema = [
                (f.name, hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                for f in dataclasses.fields(cls)
            ]
            Message._fields[cls] = schema
        return schema

    def to_bytes(self) -> bytes:
        return msgpack.packb({name: getattr(self, name) for name, _, _ in self._schema()}, use_bin_type=True)

    @classmethod
    def from_bytes(cls: type[M], data: bytes) -> M:
        return cls.from_map(unpack_map(data, cls.__name__))

    @classmethod
    def from_map(cls: type[M], raw: dict) -> M:
        """The message from an unpacked msgpack map; unknown keys are ignored (fields of newer versions)."""
        kwargs = {}
        for name, expected, required in cls._schema():
            if name not in raw:
                if required:
                    raise ValueError(f"malformed {cls.__name__}: missing field {name!r}")
                continue
            try:
                kwargs[name] = conform(raw[name], expected)
            except Mismatch:
                raise ValueError(f"malformed {cls.__name__}: field {name!r} must be {type_name(expected)}") from None
        return cls(**kwargs)


@dataclasses.dataclass(frozen=True)
class InfoRequest(Message):
    """Ask a peer what it serves; ``proof`` is the caller's admission proof (empty in a public swarm)."""

    proof: bytes = b""


@dataclasses.dataclass(frozen=True)
class ForwardRequest(Message):
    """On a stream: run the message's hidden states through blocks ``[start, end)`` (no cache, no session)."""

    start: int
    end: int


@dataclasses.dataclass(frozen=True)
class InferenceOpen(Message):
    """Open a session on this stream (or, with ``resume``, re-attach a detached one of the same client)."""

    session_id: str  # random, chosen by the client; bound to the client's peer id
    start: int
    end: int
    max_length: int  # tokens the session may hold (prompt + new tokens)
    batch_size: int
    resume: bool = False


@dataclasses.dataclass(frozen=True)
class InferenceStep(Message):
    """Steps of one or more sessions of this stream; their rows are concatenated in one tensor, in order.

    Each session's tokens start at its ``positions[i]``; a position below the session's length rolls its
    cache back to it. All parts have the same number of new tokens.
    """

    session_ids: list[str]
    positions: list[int]


@dataclasses.dataclass(frozen=True)
class InferenceClose(Message):
    """Free these sessions now, or with ``detach`` keep them (until the timeout) for a resume elsewhere."""

    session_ids: list[str]
    detach: bool = False


@dataclasses.dataclass(frozen=True)
class InferenceHello(Message):
    """First request of a stream: the client's handshake (``privacy.channel.ClientHandshake``; empty for a
    plaintext stream) and its admission proof (``privacy.admission``; empty in a public swarm)."""

    hello: bytes = b""
    proof: bytes = b""
    heartbeat: bool = False  # ask the peer for a heartbeat every HEARTBEAT_PERIOD s while it works on our requests


@dataclasses.dataclass(frozen=True)
class TrainOpen(Message):
    """Join training run ``run_id`` with this peer's blocks ``[start, end)`` (its whole span): the run's
    optimizer config (``peers.training.OptimConfig.to_dict()``) and micro-batches per optimizer step."""

    run_id: str
    start: int
    end: int
    optim: dict[str, Any]
    accumulation: int
    keep_activations: bool = True  # keep each micro-batch's graph until its backward (else recompute)
    checkpoint_every: int = 0  # save weights + AdamW state every N optimizer steps (0: never)
    replicas: list[str] = dataclasses.field(default_factory=list)  # peer ids of the run's other replicas of this span
    average_every: int = 0  # H: average parameters with the replicas every H local steps (0: never)
    outer_lr: float = 1.0  # DiLoCo outer step: Nesterov SGD on (anchor - average); lr 1, momentum 0 = plain mean
    outer_momentum: float = 0.0
    explicit_apply: bool = False  # step only on TrainApply (two-phase), not after `accumulation` backwards
    run_step: int = 0  # the run's optimizer steps so far: a replica that joins mid-run starts counting there


@dataclasses.dataclass(frozen=True)
class TrainApply(Message):
    """Commit the step: apply the ``micro_batches`` accumulated since the last step (refused if any is missing)."""

    run_id: str
    micro_batches: int


@dataclasses.dataclass(frozen=True)
class ParamsPush(Message):
    """From a replica of the same span in run ``run_id``: its flat parameters for averaging round ``round``."""

    run_id: str
    round: int


@dataclasses.dataclass(frozen=True)
class ParamsFetch(Message):
    """Ask a peer serving the same span for its current flat parameters (a late replica joining)."""

    start: int
    end: int


@dataclasses.dataclass(frozen=True)
class TrainForward(Message):
    """A training forward of micro-batch ``micro_id`` (the message's tensor: hidden states)."""

    run_id: str
    micro_id: str


@dataclasses.dataclass(frozen=True)
class TrainBackward(Message):
    """The backward of ``micro_id``: the tensor is the grad of its outputs, or with ``recompute`` the
    micro-batch's input and that grad stacked on a new first dim (stateless: the peer kept nothing)."""

    run_id: str
    micro_id: str
    recompute: bool = False


@dataclasses.dataclass(frozen=True)
class InferenceReply(Message):
    """Reply to an open or a step. ``error`` refuses the whole message; ``errors[i]`` refuses part i only
    (its session stays as it was). The tensor holds the outputs of the accepted parts, in order."""

    error: str = ""
    errors: list[str] = dataclasses.field(default_factory=list)  # one per part of a step
    length: int = 0  # tokens the session holds after an open
    handshake: bytes = b""  # the peer's handshake reply to a hello
    step: int = 0  # training: optimizer steps this stage has done
    compute_ms: float = 0.0  # training: time this request spent computing on the peer
    heartbeat: float = 0.0  # in a hello's reply: the period of the heartbeats the peer will send (0: none)
    alive: bool = False  # a heartbeat: not a reply to any request


INFERENCE_KINDS: dict[str, type[Message]] = {
    "hello": InferenceHello, "open": InferenceOpen, "step": InferenceStep, "close": InferenceClose,
    "forward": ForwardRequest, "train_open": TrainOpen, "train_forward": TrainForward, "train_backward": TrainBackward,
    "params_push": ParamsPush, "params_fetch": ParamsFetch, "train_apply": TrainApply,
}


def pack_inference(message: Message) -> bytes:
    """An inference request's metadata: its fields plus its kind."""
    kind = next(k for k, cls in INFERENCE_KINDS.items() if isinstance(message, cls))
    return msgpack.packb({"kind": kind, **{n: getattr(message, n) for n, _, _ in message._schema()}},
                         use_bin_type=True)


def unpack_inference(data: bytes) -> Message:
    """Parse an inference request; ``ValueError`` if it is malformed or of an unknown kind."""
    raw = unpack_map(data, "inference request")
    kind = raw.get("kind")
    if not isinstance(kind, str) or kind not in INFERENCE_KINDS:  # e.g. {"kind": []}: unhashable (finding 7)
        shown = repr(kind[:64]) if isinstance(kind, str) else f"of type {type(kind).__name__}"
        raise ValueError(f"unknown inference request kind {shown}; expected one of {sorted(INFERENCE_KINDS)}")
    return INFERENCE_KINDS[kind].from_map(raw)


@dataclasses.dataclass(frozen=True)
class StageInfo(Message):
    """What ``rpc_info`` returns: enough for a client to form valid requests."""

    peer_id: str
    model: str
    start: int
    end: int
    hidden_size: int
    dtype: str
    max_batch_size: int
    max_seq_len: int
    max_request_bytes: int
    throughput: float
    version: str
    cache_tokens: int = 0  # inference cache budget: batch rows x tokens, over all sessions
    cache_tokens_free: int = 0
    session_timeout: float = 0.0  # seconds an idle session is kept
    sessions: int = 0  # open inference sessions
    inference_steps: int = 0  # session steps served so far
    inference_batches: int = 0  # batched forwards that ran them (fewer than steps when batching works)
    train_steps: int = 0  # optimizer steps of the training run this peer takes part in
    opens_waiting: int = 0  # session opens waiting for cache space


class RequestError(ValueError):
    """A peer refused a request; the message says why and what to change."""


NOT_ADMITTED = "not admitted"  # how a private swarm's peer refuses a non-member, or a revoked or expired one


class NotAdmittedError(MembershipError, RequestError):
    """A peer refused us as no member (no, expired or revoked certificate): final, every member answers the same
    until the swarm owner issues a new invite."""


CAPACITY_REFUSAL = "busy:"  # how a refusal for lack of capacity starts: retry later or elsewhere, not a failure


class CapacityError(RequestError):
    """A peer has no room for this request now (its cache, or this client's share of it, is full)."""


HEARTBEAT_METADATA = InferenceReply(alive=True).to_bytes()  # a heartbeat frame's metadata (and no tensor)
HEARTBEAT_PERIOD = 1.0  # seconds between a peer's heartbeats on a stream whose requests it is working on
INFERENCE_HANDLE = "fusionswarm.StageService.rpc_inference"  # the stream's handle (framed by peers.framing)


class StageService(ServicerBase):
    """The unary RPCs of a stage peer. Handle names are fixed so that any subclass serves the same protocol.

    The long-lived stream (``INFERENCE_HANDLE``) that carries every tensor between a client and the peer is not a
    hivemind protobuf handler: ``peers.framing`` reads it with a size cap and a deadline-safe queue. It carries
    a hello (handshake + admission), then forwards, inference sessions (open, steps, close) and training calls.
    """

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        name = f"fusionswarm.StageService.{method_name}"
        return name if namespace is None else f"{namespace}::{name}"

    async def rpc_info(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertInfo:
        """``request.metadata`` is an ``InfoRequest``; the reply's ``serialized_info`` a ``StageInfo``."""
        raise NotImplementedError


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
    tensor = tensor.detach().cpu()
    if tensor.dtype != torch.bfloat16:
        return serialize_torch_tensor(tensor)
    return runtime_pb2.Tensor(compression=runtime_pb2.CompressionType.NONE, size=tensor.shape, dtype="bfloat16",
                              buffer=tensor.contiguous().view(torch.int16).numpy().tobytes())


def tensor_messages(
    tensor: torch.Tensor, metadata: bytes, cls: type = runtime_pb2.ExpertRequest,
    seal: Callable[[bytes, bytes], bytes] | None = None,
) -> Iterator[Any]:
    """Serialize ``tensor`` into stream messages; the first one carries ``metadata``.

    ``seal(buffer, metadata)``, if given, encrypts the tensor's bytes (shape and dtype stay in the clear).
    """
    serialized = serialize(tensor)
    if seal is not None:
        serialized.buffer = seal(serialized.buffer, metadata)
    for i, chunk in enumerate(split_for_streaming(serialized, CHUNK_BYTES)):
        yield cls(tensors=[chunk], metadata=metadata if i == 0 else b"")


async def read_tensor_messages(
    stream: AsyncIterator[Any], max_bytes: int, first: Any | None = None,
    unseal: Callable[[bytes, bytes], bytes] | None = None,
) -> tuple[bytes, torch.Tensor]:
    """Collect one tensor (and the first message's metadata) from a stream of chunked messages.

    ``first``, if given, is a message already taken from ``stream``. Reads exactly the tensor's chunks, so
    a long-lived stream can carry many tensors one after another. Raises ``RequestError`` if the stream
    ends early, the chunks are malformed or exceed ``max_bytes`` (or declare more chunks than ``max_bytes``
    allows: a tensor is kept as its chunks' buffers only, never more of them), ``unseal``'s error if it refuses.
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
    return first.metadata, decode_tensor(serialized)


def decode_tensor(serialized: runtime_pb2.Tensor) -> torch.Tensor:
    """An uncompressed tensor of a wire dtype whose buffer matches its shape (checked before anything is
    allocated; never requiring grad), else ``RequestError``."""
    if serialized.dtype not in WIRE_DTYPES:
        raise RequestError(f"dtype {serialized.dtype[:32]!r} is not accepted; send one of {sorted(WIRE_DTYPES)}")
    if serialized.compression != runtime_pb2.CompressionType.NONE:
        raise RequestError(f"malformed tensor: compression type {serialized.compression} is not accepted; "
                           f"send uncompressed (NONE) tensors")
    if len(serialized.size) > MAX_DIMS:
        raise RequestError(f"malformed tensor: {len(serialized.size)} dimensions, at most {MAX_DIMS} accepted")
    numel = math.prod(serialized.size)
    legacy = {numel * 4} if serialized.dtype == "bfloat16" else set()  # hivemind's legacy bfloat16 mode sends fp32
    sizes = {numel * WIRE_DTYPES[serialized.dtype].itemsize, *legacy}
    if len(serialized.buffer) not in sizes:
        shape = tuple(serialized.size)
        raise RequestError(f"tensor of shape {shape} does not match its {len(serialized.buffer)} bytes")
    try:
        return deserialize_torch_tensor(serialized).detach()
    except Exception as e:
        raise RequestError(f"malformed tensor: {e}") from e
