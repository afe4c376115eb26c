"""Each kind of bad request gets a clear error back, and the peer keeps serving everyone else."""

from __future__ import annotations

import asyncio

import pytest
import torch

from peers.wire.errors import RequestError
from peers.wire.messages import ForwardRequest, pack_inference
from peers.wire.stream import PeerStream
from peers.wire.tensors import tensor_messages


def _peer(llama_client, start: int) -> str:
    return next(r.peer_id for r in llama_client.records() if r.start == start)


def _call(llama_client, hidden, start=0, end=4, peer_start=0):
    peer_id = _peer(llama_client, peer_start)
    return llama_client._loop.run(llama_client.call_forward(peer_id, hidden, start, end))


def _assert_still_serving(llama_client):
    out = _call(llama_client, torch.randn(1, 4, 64))
    assert out.shape == (1, 4, 64) and torch.isfinite(out).all()


@pytest.mark.parametrize(
    "hidden, start, end, message",
    [
        (torch.randn(1, 4, 32), 0, 4, "must be [batch, seq, 64]"),
        (torch.randn(4, 64), 0, 4, "must be [batch, seq, 64]"),
        (torch.randn(1, 4, 64, dtype=torch.float64), 0, 4, "dtype 'float64' is not accepted"),
        (torch.ones(1, 4, 64, dtype=torch.int64), 0, 4, "dtype 'int64' is not accepted"),
        (torch.full((1, 4, 64), float("nan")), 0, 4, "NaN or infinite"),
        (torch.full((1, 4, 64), float("inf")), 0, 4, "NaN or infinite"),
        (torch.randn(9, 4, 64), 0, 4, "above this peer's limit of 8"),
        (torch.randn(1, 4, 64), 4, 8, "serves blocks 0:4, not 4:8"),
        (torch.randn(1, 4, 64), 2, 6, "serves blocks 0:4, not 2:6"),
        (torch.randn(1, 4, 64), 3, 3, "serves blocks 0:4, not 3:3"),
        (torch.randn(1, 513, 64), 0, 4, "this model takes 1..512"),
        (torch.randn(8, 1000, 64), 0, 4, "exceeds this peer's limit of 2000000 bytes"),
    ],
)
def test_bad_request_is_refused_and_peer_keeps_serving(llama_client, hidden, start, end, message):
    with pytest.raises(RequestError) as info:
        _call(llama_client, hidden, start, end)
    assert message in str(info.value)
    _assert_still_serving(llama_client)


async def _encrypted_stream(llama_client, peer_id: str) -> PeerStream:
    return await PeerStream.connect(llama_client.node.p2p, peer_id, timeout=10)


def test_malformed_metadata_is_refused(llama_client):
    peer_id = _peer(llama_client, 0)

    async def go():
        stream = await _encrypted_stream(llama_client, peer_id)
        try:
            bad, _ = await stream._request(b"\xc1 not msgpack", torch.randn(1, 2, 64), 10)
            good = await stream.forward(0, 4, torch.randn(1, 2, 64), 10)  # the same stream goes on serving
            return bad.error, good
        finally:
            stream.shutdown()

    error, good = llama_client._loop.run(go())
    assert "malformed inference request" in error and good.shape == (1, 2, 64)
    _assert_still_serving(llama_client)


def test_oversized_tensor_is_skipped_and_the_stream_stays_in_step(llama_client):
    peer_id = _peer(llama_client, 0)

    async def go():
        stream = await _encrypted_stream(llama_client, peer_id)
        try:
            with pytest.raises(RequestError, match="exceeds this peer's limit"):
                await stream.forward(0, 4, torch.randn(8, 1200, 64), 10)
            return await stream.forward(0, 4, torch.randn(1, 2, 64), 10)
        finally:
            stream.shutdown()

    assert llama_client._loop.run(go()).shape == (1, 2, 64)


def test_truncated_stream_is_refused(llama_client):
    """A client that sends the first chunk of a multi-chunk tensor and then hangs up loses only its request."""
    peer_id = _peer(llama_client, 0)

    async def go():
        stream = await _encrypted_stream(llama_client, peer_id)
        metadata = pack_inference(ForwardRequest(start=0, end=4))
        messages = list(tensor_messages(torch.randn(4, 1200, 64), metadata, seal=stream._seal))
        assert len(messages) > 1
        future = stream.send_raw(messages[:1], hang_up=True)  # hang up after the first chunk
        reply, _ = await asyncio.wait_for(future, 10)
        return reply.error

    assert "stream ended after 1 of" in llama_client._loop.run(go())
    _assert_still_serving(llama_client)
