"""Fuzz the stream's parsers: every message type, inference requests, tensor chunks and tensors.

Property: each parser returns a valid object or raises its documented error (``ValueError`` for metadata,
``RequestError`` for tensors, ``ChannelError`` for a sealed tensor that fails to open), nothing else, and keeps
no more memory than the bytes it was actually sent.
"""

from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace
from typing import Any, get_args, get_origin

import msgpack
import pytest
import torch
from fuzz_strategies import DEEP, INTS, VALUES, Deep, mutated, pack, shaped_maps
from hivemind.proto import runtime_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from peers.training import OptimConfig
from peers.wire.errors import RequestError
from peers.wire.messages import (
    INFERENCE_KINDS,
    InferenceReply,
    InferenceStep,
    InfoRequest,
    Message,
    StageInfo,
    TrainOpen,
    pack_inference,
    unpack_inference,
)
from peers.wire.tensors import (
    CHUNK_BYTES,
    MAX_DIMS,
    WIRE_DTYPES,
    decode_tensor,
    read_tensor_messages,
    sealer,
    tensor_messages,
    unsealer,
)
from peers.wire.values import conform
from privacy.channel import ClientHandshake, accept_handshake
from privacy.errors import ChannelError
from privacy.identity import Identity

RUN = asyncio.new_event_loop().run_until_complete  # one loop for every example: asyncio.run costs ms each
CLASSES = sorted({*INFERENCE_KINDS.values(), InferenceReply, StageInfo, InfoRequest}, key=lambda c: c.__name__)


def typed(expected: Any) -> st.SearchStrategy:
    """Well-typed values of a field annotation (at the edges of their ranges)."""
    if get_origin(expected) is list:
        return st.lists(typed(get_args(expected)[0]), max_size=4)
    if get_origin(expected) is dict:
        return st.dictionaries(st.text(max_size=8), VALUES, max_size=4)
    return {int: INTS, float: st.floats() | INTS, bool: st.booleans(), str: st.text(max_size=20),
            bytes: st.binary(max_size=40)}[expected]


def fields(cls: type[Message]) -> dict[str, st.SearchStrategy]:
    return {name: typed(expected) for name, expected, _ in cls._schema()}


def assert_valid(message: Message, cls: type[Message]) -> None:
    """A parsed message: of its class, every field of its annotated type, printable, and it round-trips."""
    assert type(message) is cls
    for name, expected, _ in cls._schema():
        assert conform(getattr(message, name), expected) == getattr(message, name)
    repr(message)
    assert cls.from_bytes(message.to_bytes()) == message


def parse(cls: type[Message], data: bytes) -> None:
    try:
        message = cls.from_bytes(data)
    except ValueError:
        return
    assert_valid(message, cls)


# ---- metadata -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_message_from_shaped_maps(cls):
    @settings(max_examples=80)  # x 14 classes; unpack_inference and the mutations below add 400 more of all kinds
    @given(shaped_maps(fields(cls)))
    def check(raw):
        parse(cls, pack(raw))

    check()


@given(st.sampled_from(CLASSES), st.binary(max_size=64) | VALUES.map(pack))
def test_message_from_any_bytes(cls, data):
    parse(cls, data)


@given(st.sampled_from(CLASSES), st.data())
def test_message_from_mutated_bytes(cls, data):
    valid = data.draw(shaped_maps(fields(cls), extra=st.nothing()).map(pack))
    parse(cls, data.draw(mutated(valid)))


KIND = st.sampled_from(sorted(INFERENCE_KINDS)) | VALUES | DEEP


@given(st.sampled_from(sorted(INFERENCE_KINDS)).flatmap(
    lambda kind: st.tuples(KIND | st.just(kind), shaped_maps(fields(INFERENCE_KINDS[kind])))))
def test_unpack_inference(kind_and_map):
    kind, raw = kind_and_map
    try:
        message = unpack_inference(pack({**raw, "kind": kind}))
    except ValueError:
        return
    assert_valid(message, INFERENCE_KINDS[kind])
    assert unpack_inference(pack_inference(message)) == message


@given(st.binary(max_size=64) | VALUES.map(pack) | st.dictionaries(st.text(max_size=6), VALUES | DEEP).map(pack))
def test_unpack_inference_any_bytes(data):
    try:
        unpack_inference(data)
    except ValueError:
        pass


@pytest.mark.parametrize("kind", [[], {}, [1, [2]], {"a": 1}, Deep(0), Deep(1), None, 5, b"step", 1.5])
def test_finding_07_unhashable_kind(kind):
    """Finding 7: ``{"kind": []}`` raised an uncaught TypeError (unhashable) and killed the stream."""
    with pytest.raises(ValueError, match="unknown inference request kind"):
        unpack_inference(pack({"kind": kind, "session_ids": [], "positions": []}))


@pytest.mark.parametrize("raw, match", [
    ({"kind": "step", "session_ids": ["a", 1], "positions": [0, 0]}, r"'session_ids' must be list\[str\]"),
    ({"kind": "step", "session_ids": ["a"], "positions": ["0"]}, r"'positions' must be list\[int\]"),
    ({"kind": "step", "session_ids": ["a"], "positions": [True]}, r"'positions' must be list\[int\]"),
    ({"kind": "step", "session_ids": ["a"], "positions": [1 << 63]}, r"'positions' must be list\[int\]"),
    ({"kind": "close", "session_ids": [b"a"]}, r"'session_ids' must be list\[str\]"),
    ({"kind": "train_open", "run_id": "r", "start": 0, "end": 1, "optim": {}, "accumulation": 1,
      "replicas": [None]}, r"'replicas' must be list\[str\]"),
    ({"kind": "train_open", "run_id": "r", "start": 0, "end": 1, "optim": {b"lr": 1}, "accumulation": 1},
     r"'optim' must be dict\[str, Any\]"),
    ({"kind": "train_open", "run_id": "r", "start": 0, "end": 1, "optim": {"lr": Deep(0)}, "accumulation": 1},
     r"'optim' must be dict\[str, Any\]"),
    ({"kind": "train_open", "run_id": "r", "start": 0, "end": 1, "optim": {}, "accumulation": 1,
      "outer_lr": float("nan")}, r"'outer_lr' must be float \(finite\)"),
])
def test_list_and_dict_fields_are_checked_inside(raw, match):
    with pytest.raises(ValueError, match=match):
        unpack_inference(pack(raw))


def test_metadata_size_is_capped_before_unpacking():
    """4 MiB of one-element lists (4M containers) took 2 s of the event loop to unpack; the cap refuses it at once."""
    data = b"\xdd" + (4000).to_bytes(4, "big") + (b"\x91" * 1000 + b"\xc0") * 4000
    started = time.perf_counter()
    with pytest.raises(ValueError, match="bytes of metadata"):
        unpack_inference(data)
    with pytest.raises(ValueError, match="bytes of metadata"):
        InferenceReply.from_bytes(data)
    assert time.perf_counter() - started < 0.1
    steps = InferenceStep(session_ids=[f"{i:064x}" for i in range(512)], positions=[(1 << 62) + i for i in range(512)])
    assert unpack_inference(pack_inference(steps)) == steps  # the largest step a client sends still fits


def test_reply_errors_are_strings():
    with pytest.raises(ValueError, match=r"'errors' must be list\[str\]"):
        InferenceReply.from_bytes(pack({"errors": ["", {}]}))  # a falsy non-string read as "accepted"
    assert InferenceStep.from_bytes(pack({"session_ids": ["a"], "positions": [3]})).positions == [3]


OPTIM_KEYS = st.sampled_from(sorted(OptimConfig._TYPES)) | st.text(max_size=6)


@given(st.dictionaries(OPTIM_KEYS, VALUES | DEEP | st.lists(st.floats() | INTS, max_size=3), max_size=5))
def test_train_open_optim_never_crashes_the_optimizer_config(optim):
    """``TrainOpen.optim`` goes on to ``OptimConfig.from_dict``, whose errors the peer reports as ValueError."""
    try:
        message = TrainOpen.from_bytes(pack({"run_id": "r", "start": 0, "end": 1, "optim": optim, "accumulation": 1}))
    except ValueError:
        return
    try:
        OptimConfig.from_dict(message.optim)
    except ValueError:
        pass


# ---- tensors --------------------------------------------------------------------------------------------------

DTYPE = st.sampled_from(sorted(WIRE_DTYPES)) | st.sampled_from(["float64", "int64", "bool", "uint8", ""]) \
    | st.text(max_size=10)
COMPRESSION = st.sampled_from(list(runtime_pb2.CompressionType.values())) | st.integers(6, (1 << 31) - 1)
DIM = st.integers(0, 5) | st.integers(0, (1 << 32) - 1)


@st.composite
def tensors(draw) -> runtime_pb2.Tensor:
    dtype, size = draw(DTYPE), draw(st.lists(DIM, max_size=MAX_DIMS + 2))
    itemsize = WIRE_DTYPES[dtype].itemsize if dtype in WIRE_DTYPES else 4
    numel = math.prod(size)
    exact = [numel * itemsize, numel * 4] if numel * 4 <= 4096 else []
    length = draw(st.sampled_from(exact) | st.integers(0, 300) if exact else st.integers(0, 300))
    return runtime_pb2.Tensor(buffer=draw(st.binary(min_size=length, max_size=length)), size=size, dtype=dtype,
                              compression=draw(COMPRESSION), requires_grad=draw(st.booleans()))


@given(tensors())
def test_decode_tensor(serialized):
    try:
        tensor = decode_tensor(serialized)
    except RequestError:
        return
    assert list(tensor.shape) == list(serialized.size) and tensor.dtype == WIRE_DTYPES[serialized.dtype]
    assert not tensor.requires_grad and tensor.numel() * tensor.element_size() <= len(serialized.buffer)


def test_decode_refuses_many_dims_before_multiplying_them():
    """200k declared dims: their product alone (6M bits, grown one factor at a time) took many seconds."""
    serialized = runtime_pb2.Tensor(buffer=b"", size=[(1 << 32) - 1] * 200_000, dtype="float32")
    started = time.perf_counter()
    with pytest.raises(RequestError, match="dimensions"):
        decode_tensor(serialized)
    assert time.perf_counter() - started < 0.5


@pytest.mark.parametrize("compression", [c for c in runtime_pb2.CompressionType.values() if c] + [77])
def test_decode_refuses_compressed_tensors(compression):
    serialized = runtime_pb2.Tensor(buffer=b"\0" * 16, size=[4], dtype="float32", compression=compression)
    with pytest.raises(RequestError, match="not accepted"):
        decode_tensor(serialized)


async def _collect(messages, max_bytes, unseal=None):
    taken = []

    async def stream():
        for message in messages:
            taken.append(message)
            yield message

    try:
        return await read_tensor_messages(stream(), max_bytes, unseal=unseal), len(taken)
    except RequestError:
        return None, len(taken)


def chunk(buffer: bytes, metadata: bytes = b"", tensors: int = 1, **head) -> runtime_pb2.ExpertRequest:
    part = runtime_pb2.Tensor(buffer=buffer, **head)
    return runtime_pb2.ExpertRequest(tensors=[part] * tensors, metadata=metadata)


@st.composite
def chunk_streams(draw) -> list:
    head = dict(size=draw(st.lists(st.integers(0, 70), max_size=3)), dtype=draw(DTYPE),
                chunks=draw(st.integers(-3, 6) | st.integers(-(1 << 31), (1 << 31) - 1)))
    first = chunk(draw(st.binary(max_size=300)), draw(st.binary(max_size=20)), draw(st.integers(0, 2)), **head)
    rest = draw(st.lists(st.builds(chunk, st.binary(max_size=300), st.binary(max_size=8),
                                   st.sampled_from([1, 1, 1, 0, 2])), max_size=8))
    return [first, *rest]


@given(chunk_streams(), st.integers(0, 1500))
def test_read_tensor_messages(messages, max_bytes):
    result, taken = RUN(_collect(messages, max_bytes))
    declared = max(1, messages[0].tensors[0].chunks) if len(messages[0].tensors) == 1 else 1
    assert taken <= declared  # never reads into the next request
    if result is not None:
        assert taken == declared and sum(len(m.tensors[0].buffer) + len(m.metadata) for m in messages[:taken]) \
            <= max_bytes
        assert isinstance(result[1], torch.Tensor)


class Counted(bytes):
    """A chunk buffer that counts how many of its kind are alive."""

    alive = 0

    def __new__(cls, data: bytes):
        Counted.alive += 1
        return super().__new__(cls, data)

    def __del__(self):
        Counted.alive -= 1


@pytest.mark.parametrize("declared, size, max_bytes", [
    ((1 << 31) - 1, 1, 4 * CHUNK_BYTES),  # 2^31 declared chunks of 1 byte: at most 4 may ever be kept
    (10_000, 100, 4 * CHUNK_BYTES),
    (3000, 1000, 1 << 20),
])
def test_reader_keeps_no_more_chunks_than_max_bytes_allows(declared, size, max_bytes):
    """Declared chunk counts are not trusted: tiny chunks past what ``max_bytes`` allows are dropped as they come."""
    most = max(1, -(-max_bytes // CHUNK_BYTES))
    peak, sent = 0, 3000

    async def stream():
        nonlocal peak
        yield SimpleNamespace(metadata=b"m", tensors=[SimpleNamespace(buffer=Counted(b"x" * size), chunks=declared,
                                                                      size=[4], dtype="float32", compression=0)])
        for _ in range(sent):
            peak = max(peak, Counted.alive)
            yield SimpleNamespace(metadata=b"", tensors=[SimpleNamespace(buffer=Counted(b"x" * size))])

    with pytest.raises(RequestError, match="stream ended after|declares|exceeds"):
        RUN(read_tensor_messages(stream(), max_bytes))
    assert peak <= most + 8  # a few more are alive in the generator and the reader's locals


def _channels():
    identity = Identity.generate()
    client = ClientHandshake(identity.public_bytes, b"fuzz-session")
    reply, peer = accept_handshake(client.hello(), identity)
    return client.finish(reply), peer


CHANNELS = _channels()  # one session for all examples: each must leave it usable for the next


@given(st.data())
def test_sealed_tensor_tampered_in_transit(data):
    """A tampered sealed chunk is refused (ChannelError, or RequestError if its sizes broke), and the next
    genuine tensor still opens: one forgery does not kill the session."""
    client, peer = CHANNELS
    tensor = torch.randn(data.draw(st.integers(1, 3)), data.draw(st.integers(1, 40)))
    messages = list(tensor_messages(tensor, b"meta", seal=sealer(client)))
    index = data.draw(st.integers(0, len(messages) - 1))
    part = messages[index].tensors[0]
    part.buffer = data.draw(mutated(part.buffer))
    try:
        result, _ = RUN(_collect(messages, 1 << 20, unseal=unsealer(peer)))
    except ChannelError:
        result = None
    if result is not None:
        assert torch.equal(result[1], tensor)
    again = torch.randn(2, 3)
    good, _ = RUN(_collect(list(tensor_messages(again, b"m2", seal=sealer(client))), 1 << 20,
                                   unseal=unsealer(peer)))
    assert torch.equal(good[1], again)


def test_compressed_legacy_and_metadata_edge_cases_round_trip():
    """Sanity: what our own senders produce still parses (all dtypes, empty tensors, no metadata)."""
    for dtype in WIRE_DTYPES.values():
        for shape in [(0, 3), (2, 3, 4), ()]:
            tensor = torch.randn(shape).to(dtype)
            (result, taken) = RUN(_collect(list(tensor_messages(tensor, b"")), 1 << 20))
            assert taken == 1 and torch.equal(result[1], tensor)
    assert msgpack.unpackb(pack_inference(InferenceStep(["a"], [1])))["kind"] == "step"
