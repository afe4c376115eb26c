"""Wire messages (msgpack metadata, checked field by field) and chunked tensor streams."""

from __future__ import annotations

import asyncio
import math

import msgpack
import pytest
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2

from peers.wire.errors import RequestError
from peers.wire.messages import ForwardRequest, InferenceHello, InferenceReply, InfoRequest, StageInfo
from peers.wire.service import INFERENCE_HANDLE, StageService
from peers.wire.tensors import CHUNK_BYTES, decode_tensor, read_tensor_messages, tensor_messages

INFO = dict(peer_id="12D3KooW" + "A" * 44, model="llama-tiny", start=0, end=4, hidden_size=64, dtype="float32",
            max_batch_size=8, max_seq_len=512, max_request_bytes=1 << 20, throughput=123.5, version="0.1.0")


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


async def _stream(messages):
    for message in messages:
        yield message


def read(messages, max_bytes: int = 1 << 30):
    return asyncio.run(read_tensor_messages(_stream(messages), max_bytes))


# ---- metadata messages ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls, data, match",
    [
        (ForwardRequest, b"\xc1", "malformed ForwardRequest"),  # 0xc1 is never used by msgpack
        (ForwardRequest, b"", "malformed ForwardRequest"),
        (ForwardRequest, b"\x92\x01", "malformed ForwardRequest"),  # truncated array
        (ForwardRequest, pack({"start": 0, "end": 1}) + b"\x00", "malformed ForwardRequest"),  # trailing bytes
        (ForwardRequest, pack({1: 0, 2: 1}), "malformed ForwardRequest"),  # non-string map keys
        (ForwardRequest, pack([0, 4]), "expected a map"),
        (ForwardRequest, pack(4), "expected a map"),
        (ForwardRequest, pack("start=0"), "expected a map"),
        (ForwardRequest, pack(None), "expected a map"),
        (ForwardRequest, pack({"start": 0}), "missing field 'end'"),
        (ForwardRequest, pack({}), "missing field 'start'"),
        (ForwardRequest, pack({"start": "0", "end": 4}), "field 'start' must be int"),
        (ForwardRequest, pack({"start": 0, "end": 4.0}), "field 'end' must be int"),
        (ForwardRequest, pack({"start": None, "end": 4}), "field 'start' must be int"),
        (ForwardRequest, pack({"start": True, "end": 4}), "field 'start' must be int"),
        (ForwardRequest, pack({"start": 0, "end": False}), "field 'end' must be int"),
        (InferenceReply, pack({"error": 5}), "field 'error' must be str"),
        (InferenceReply, pack({"error": b"bytes"}), "field 'error' must be str"),
        (InfoRequest, pack({"proof": "text"}), "field 'proof' must be bytes"),
        (InferenceHello, pack({"proof": 1}), "field 'proof' must be bytes"),
        (StageInfo, pack({**INFO, "throughput": "fast"}), "field 'throughput' must be float"),
        (StageInfo, pack({**INFO, "throughput": True}), "field 'throughput' must be float"),
        (StageInfo, pack({**INFO, "max_batch_size": True}), "field 'max_batch_size' must be int"),
        (StageInfo, pack({**INFO, "peer_id": 1}), "field 'peer_id' must be str"),
        (StageInfo, pack({k: v for k, v in INFO.items() if k != "version"}), "missing field 'version'"),
    ],
    ids=repr,
)
def test_from_bytes_errors(cls, data, match):
    with pytest.raises(ValueError, match=match):
        cls.from_bytes(data)


@pytest.mark.parametrize(
    "message",
    [
        ForwardRequest(start=0, end=4),
        ForwardRequest(start=17, end=80),
        InferenceReply(),
        InferenceReply(error="this peer serves blocks 0:4, not 2:6"),
        InferenceReply(error="ünïcödé ✓"),
        InfoRequest(proof=b"\x00proof"),
        InferenceHello(hello=b"h", proof=b"p"),
        StageInfo(**INFO),
        StageInfo(**{**INFO, "dtype": "bfloat16", "throughput": 0.0, "version": ""}),
    ],
)
def test_message_round_trip(message):
    data = message.to_bytes()
    assert isinstance(data, bytes)
    back = type(message).from_bytes(data)
    assert back == message
    assert type(back) is type(message)


@pytest.mark.parametrize(
    "cls, raw, expected",
    [
        (StageInfo, {**INFO, "throughput": 100}, StageInfo(**{**INFO, "throughput": 100.0})),  # int -> float
        (InferenceReply, {}, InferenceReply(error="")),  # defaults fill missing optional fields
        (ForwardRequest, {"start": 1, "end": 2, "newer_field": [1, 2]}, ForwardRequest(1, 2)),  # ignored
    ],
)
def test_from_bytes_coercions_and_defaults(cls, raw, expected):
    message = cls.from_bytes(pack(raw))
    assert message == expected
    if cls is StageInfo:
        assert isinstance(message.throughput, float)


def test_stage_service_declares_only_the_unary_rpc():
    """``rpc_info`` is hivemind's unary protobuf handler; the stream is ours (``peers.wire.framing``), under the
    handle name older clients dial."""
    StageService._collect_rpc_handlers()
    handlers = {h.method_name: h for h in StageService._rpc_handlers}
    assert set(handlers) == {"rpc_info"}
    assert handlers["rpc_info"].stream_input is False and handlers["rpc_info"].stream_output is False
    assert handlers["rpc_info"].request_type is runtime_pb2.ExpertRequest
    assert INFERENCE_HANDLE == StageService._get_handle_name(None, "rpc_inference")


# ---- tensor streams -------------------------------------------------------------------------------------------

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [
    (),
    (1,),
    (1, 1, 1),
    (2, 3, 64),
    (0, 5, 64),  # empty batch: one empty chunk
    (1, 4096, 64),  # exactly 1 MiB in fp32
    (1, 4097, 64),  # just over 1 MiB in fp32
    (3, 2000, 128),  # several chunks
]


def _nbytes(shape, dtype) -> int:
    """Bytes on the wire: every dtype its own size (bfloat16 too, unlike hivemind's default mode)."""
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_tensor_stream_round_trip(shape, dtype):
    torch.manual_seed(0)
    tensor = torch.randn(shape).to(dtype)
    metadata = ForwardRequest(2, 6).to_bytes()
    messages = list(tensor_messages(tensor, metadata))
    assert len(messages) == max(1, math.ceil(_nbytes(shape, dtype) / CHUNK_BYTES))
    assert all(isinstance(m, runtime_pb2.ExpertRequest) for m in messages)
    assert messages[0].metadata == metadata
    assert all(m.metadata == b"" for m in messages[1:])
    assert all(len(m.tensors) == 1 and len(m.tensors[0].buffer) <= CHUNK_BYTES for m in messages)

    got_metadata, got = read(messages)
    assert got_metadata == metadata
    assert got.dtype == dtype
    assert got.shape == tensor.shape
    assert torch.equal(got, tensor)


def test_tensor_messages_response_class_and_grad():
    tensor = torch.randn(2, 3, requires_grad=True)
    messages = list(tensor_messages(tensor * 2, b"x", runtime_pb2.ExpertResponse))
    assert [type(m) for m in messages] == [runtime_pb2.ExpertResponse]
    _, got = read(messages)
    assert torch.equal(got, (tensor * 2).detach())


def test_read_stops_at_last_chunk():
    """Messages after the tensor's last chunk are left in the stream for the handler to drain."""
    tensor = torch.randn(1, 5000, 64)
    messages = list(tensor_messages(tensor, b"meta"))
    consumed = []

    async def stream():
        for m in [*messages, runtime_pb2.ExpertRequest(metadata=b"extra")]:
            consumed.append(m)
            yield m

    metadata, got = asyncio.run(read_tensor_messages(stream(), 1 << 30))
    assert metadata == b"meta" and torch.equal(got, tensor)
    assert len(consumed) == len(messages)


@pytest.mark.parametrize(
    "shape, dtype, slack, ok",
    [
        ((16, 64), torch.float32, 0, True),  # exactly at the limit (buffer + metadata)
        ((16, 64), torch.float32, -1, False),
        ((16, 64), torch.bfloat16, 0, True),
        ((16, 64), torch.bfloat16, -1, False),
        ((1, 5000, 64), torch.float32, 0, True),  # two chunks
        ((1, 5000, 64), torch.float32, -1, False),
        ((1, 5000, 64), torch.float32, -(1 << 20), False),  # refused at the first chunk already
    ],
)
def test_max_bytes(shape, dtype, slack, ok):
    tensor = torch.randn(shape).to(dtype)
    metadata = b"0123456789"
    messages = list(tensor_messages(tensor, metadata))
    limit = _nbytes(shape, dtype) + len(metadata) + slack
    if ok:
        _, got = read(messages, limit)
        assert torch.equal(got, tensor)
    else:
        with pytest.raises(RequestError, match=f"limit of {limit} bytes"):
            read(messages, limit)


@pytest.mark.parametrize(
    "keep, match",
    [
        (0, "stream ended"),  # before any tensor
        (1, "stream ended after 1 of 3 chunks"),
        (2, "stream ended after 2 of 3 chunks"),
    ],
)
def test_truncated_stream(keep, match):
    tensor = torch.randn(3, 2000, 128)  # 3 MiB in fp32: 3 chunks
    messages = list(tensor_messages(tensor, b"m"))
    assert len(messages) == 3
    with pytest.raises(RequestError, match=match):
        read(messages[:keep])


@pytest.mark.parametrize(
    "make_messages, match",
    [
        (lambda t: [runtime_pb2.ExpertRequest(metadata=b"m")], "expected one tensor per message, got 0"),
        (lambda t: [runtime_pb2.ExpertRequest(tensors=[t, t])], "expected one tensor per message, got 2"),
    ],
)
def test_malformed_first_message(make_messages, match):
    serialized = serialize_torch_tensor(torch.zeros(2, 2))
    with pytest.raises(RequestError, match=match):
        read(make_messages(serialized))


@pytest.mark.parametrize("extra_tensors", [0, 2])
def test_malformed_chunk_message(extra_tensors):
    messages = list(tensor_messages(torch.randn(1, 5000, 64), b"m"))
    part = messages[1].tensors[0]
    messages[1] = runtime_pb2.ExpertRequest(tensors=[part] * extra_tensors)
    with pytest.raises(RequestError, match="exactly one tensor part"):
        read(messages)


# ---- decode_tensor --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.int32, torch.uint8, torch.bool])
def test_decode_refuses_other_dtypes(dtype):
    serialized = serialize_torch_tensor(torch.ones(2, 3, dtype=dtype))
    with pytest.raises(RequestError, match="is not accepted"):
        decode_tensor(serialized)


@pytest.mark.parametrize(
    "shape, dtype, buffer_bytes",
    [
        ((2, 3), torch.float32, 23),
        ((2, 3), torch.float32, 25),
        ((2, 3), torch.float32, 0),
        ((2, 3), torch.float16, 13),
        ((2, 3), torch.float16, 48),  # only bfloat16 may come as fp32
        ((2, 3), torch.bfloat16, 16),
        ((1000, 1000), torch.float32, 4),  # a huge claimed shape with a tiny buffer
    ],
)
def test_decode_refuses_size_mismatch(shape, dtype, buffer_bytes):
    serialized = runtime_pb2.Tensor(
        compression=runtime_pb2.CompressionType.NONE, buffer=b"\x00" * buffer_bytes, size=shape,
        dtype=str(dtype).removeprefix("torch."),
    )
    with pytest.raises(RequestError, match="does not match"):
        decode_tensor(serialized)


def test_decode_refuses_altered_size():
    serialized = serialize_torch_tensor(torch.randn(4, 8))
    del serialized.size[:]
    serialized.size.extend([4, 9])
    with pytest.raises(RequestError, match=r"shape \(4, 9\) does not match its 128 bytes"):
        decode_tensor(serialized)


def test_bfloat16_travels_in_two_bytes_and_hivemind_reads_it():
    values = torch.randn(3, 5).to(torch.bfloat16)
    (message,) = tensor_messages(values, b"m")
    assert len(message.tensors[0].buffer) == 2 * 15 and message.tensors[0].dtype == "bfloat16"
    assert torch.equal(deserialize_torch_tensor(message.tensors[0]), values)  # hivemind's own reader
    assert torch.equal(decode_tensor(message.tensors[0]), values)


def test_decode_accepts_legacy_bfloat16_as_fp32():
    """Older hivemind sends bfloat16 as float32 bytes; decode_tensor accepts both sizes."""
    values = torch.randn(3, 5).to(torch.bfloat16)
    serialized = runtime_pb2.Tensor(
        compression=runtime_pb2.CompressionType.NONE, buffer=values.float().numpy().tobytes(), size=[3, 5],
        dtype="bfloat16",
    )
    got = decode_tensor(serialized)
    assert got.dtype == torch.bfloat16 and torch.equal(got, values)


C = runtime_pb2.CompressionType


@pytest.mark.parametrize(
    "compression, buffer, size",
    [
        (C.FLOAT16, b"\0" * 3, [2]),  # not a whole number of fp16 values
        (C.FLOAT16, b"\0" * 8, [3, 3]),  # 4 values for 9
        (C.MEANSTD_16BIT, b"\0" * 3, [2, 2]),
        (C.UNIFORM_8BIT, b"\0" * 3, [2, 2]),
        (C.QUANTILE_8BIT, b"", [2, 2]),
    ],
)
def test_decode_wraps_deserialization_errors(compression, buffer, size):
    serialized = runtime_pb2.Tensor(compression=compression, buffer=buffer, size=size, dtype="float32")
    with pytest.raises(RequestError, match="malformed tensor"):
        decode_tensor(serialized)


def test_inference_requests_round_trip_with_their_kind():
    from peers.wire.messages import InferenceClose, InferenceOpen, InferenceStep, pack_inference, unpack_inference

    for message in (
        InferenceOpen(session_id="s", start=0, end=4, max_length=8, batch_size=1, resume=True),
        InferenceStep(session_ids=["a", "b"], positions=[0, 3]),
        InferenceClose(session_ids=["a"], detach=True),
    ):
        assert unpack_inference(pack_inference(message)) == message


@pytest.mark.parametrize("data, message", [
    (b"\xc1", "malformed inference request"),
    (msgpack.packb([1, 2]), "malformed inference request"),
    (msgpack.packb({"kind": "jump"}), "unknown inference request kind 'jump'"),
    (msgpack.packb({"kind": "step", "session_ids": "ab", "positions": [0]}), "must be list"),
])
def test_bad_inference_requests_are_refused(data, message):
    from peers.wire.messages import unpack_inference

    with pytest.raises(ValueError, match=message):
        unpack_inference(data)
