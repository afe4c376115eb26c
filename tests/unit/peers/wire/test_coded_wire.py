"""Coded tensors on the stream (``peers.wire.tensors``): each codec through chunk messages, sealed and in the clear;
the wire's byte limit and the decoded-size limit; the codec's header is sealed with its data."""

from __future__ import annotations

import asyncio
import struct

import pytest
import torch
from hivemind.proto import runtime_pb2

from peers.wire.errors import RequestError
from peers.wire.tensors import CHUNK_BYTES, read_coded_messages, read_tensor_messages, sealer, tensor_messages, unsealer
from privacy.channel import ClientHandshake, accept_handshake, new_session_id
from privacy.errors import ChannelError
from privacy.identity import Identity
from swarm.compression import NONE, Codec, decode, encode
from swarm.compression.codecs import CODED, HEADER, MAGIC

CODECS = [NONE, Codec("fp16"), Codec("bf16"), Codec("int8"), Codec("topk", 0.1), Codec("topk", 0.3, "int8")]


async def _stream(messages):
    for message in messages:
        yield message


def read(messages, max_bytes: int = 1 << 30, unseal=None, **kwargs):
    return asyncio.run(read_coded_messages(_stream(messages), max_bytes, unseal=unseal, **kwargs))


def channels():
    """Both ends of an encrypted stream: (the client's channel, the peer's)."""
    peer = Identity.generate()
    handshake = ClientHandshake(peer.public_bytes, new_session_id())
    reply, server = accept_handshake(handshake.hello(), peer)
    return handshake.finish(reply), server


@pytest.mark.parametrize("codec", CODECS, ids=str)
@pytest.mark.parametrize("sealed", [False, True])
def test_each_codec_travels_in_chunks(codec, sealed):
    """A tensor of several chunks arrives as ``decode`` of its encoding would give it, sealed or not."""
    x = torch.randn(2, 300, 1024)  # 2.4 MB dense: 3 chunks uncompressed
    client, server = channels() if sealed else (None, None)
    messages = list(tensor_messages(x, b"meta", seal=sealer(client), codec=codec))
    metadata, got, indices = read(messages, unseal=unsealer(server))
    want = decode(encode(x, codec).serialized, max_bytes=1 << 30)
    assert metadata == b"meta" and torch.equal(got, want.tensor)
    assert (indices is None) == (codec.name != "topk")
    if indices is not None:
        assert torch.equal(indices, want.indices)
    if sealed:  # the coded bytes, header included, travel as ciphertext
        assert MAGIC not in b"".join(m.tensors[0].buffer for m in messages)


def test_none_is_byte_identical_to_before():
    x = torch.randn(3, 700)
    plain = list(tensor_messages(x, b"m"))
    assert [m.SerializeToString() for m in plain] == [m.SerializeToString() for m in tensor_messages(x, b"m",
                                                                                                  codec=NONE)]
    assert plain[0].tensors[0].compression == runtime_pb2.CompressionType.NONE


def test_read_tensor_messages_takes_coded_tensors_and_drops_indices():
    x = torch.randn(4, 64)
    _, got = asyncio.run(read_tensor_messages(_stream(tensor_messages(x, b"m", codec=Codec("topk", 0.5))), 1 << 20))
    assert got.shape == x.shape and (got != 0).sum() == 128


def test_forced_indices_and_encoded_tensors_travel():
    x, grad = torch.randn(8, 32), torch.randn(8, 32)
    forward = encode(x, Codec("topk", 0.25))
    _, _, indices = read(list(tensor_messages(grad, b"m", codec=Codec("topk", 0.9), indices=forward.indices)))
    assert torch.equal(indices, forward.indices)
    _, got, kept = read(list(tensor_messages(forward, b"m")))
    assert torch.equal(kept, forward.indices) and torch.equal(got.reshape(-1)[kept], x.reshape(-1)[kept])


def test_tampered_sealed_header_is_refused():
    """The codec's header is authenticated: flipping a bit of the sealed buffer fails the unsealing."""
    client, server = channels()
    messages = list(tensor_messages(torch.randn(100), b"m", seal=sealer(client), codec=Codec("fp16")))
    part = messages[0].tensors[0]
    part.buffer = bytes([part.buffer[0] ^ 1]) + part.buffer[1:]
    with pytest.raises(ChannelError):
        read(messages, unseal=unsealer(server))


def test_wire_limit_counts_coded_bytes():
    """A tensor whose dense form is over the wire limit passes once coded small enough: ``max_bytes`` is about the
    wire. Its decoded size is bounded separately (default: the same limit)."""
    x = torch.randn(4, CHUNK_BYTES // 8)  # 2 MiB dense, 0.5 MiB in int8
    with pytest.raises(RequestError, match="limit"):
        read(list(tensor_messages(x, b"m")), max_bytes=1 << 20)
    _, got, _ = read(list(tensor_messages(x, b"m", codec=Codec("int8"))), max_bytes=1 << 20, max_decoded_bytes=4 << 20)
    assert got.shape == x.shape
    with pytest.raises(RequestError, match="malformed.*limit"):  # decoded bound defaults to max_bytes
        read(list(tensor_messages(x, b"m", codec=Codec("int8"))), max_bytes=1 << 20)


def test_crafted_topk_declaring_a_huge_tensor_is_refused():
    """A message of a few bytes declaring a dense tensor of 10^12+ elements is refused (RequestError) without
    allocating it."""
    buffer = HEADER.pack(MAGIC, 4, 0, 1, 0, 1) + struct.pack("<i", 3) + b"\0" * 4
    part = runtime_pb2.Tensor(compression=CODED, size=[1 << 20, 1 << 20], dtype="float32", buffer=buffer)
    with pytest.raises(RequestError, match="malformed.*limit"):
        read([runtime_pb2.ExpertRequest(tensors=[part], metadata=b"m")], max_bytes=64 << 20)


def test_malformed_coded_tensor_is_a_request_error():
    part = runtime_pb2.Tensor(compression=CODED, size=[4], dtype="float32", buffer=HEADER.pack(MAGIC, 1, 0, 0, 0, 0))
    with pytest.raises(RequestError, match="malformed"):
        read([runtime_pb2.ExpertRequest(tensors=[part], metadata=b"m")])
