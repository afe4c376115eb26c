"""Each kind of bad request gets a clear error back, and the peer keeps serving everyone else."""

from __future__ import annotations

import pytest
import torch
from hivemind.p2p import PeerID

from peers.protocol import ForwardReply, RequestError, StageService, tensor_messages


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


def test_malformed_metadata_is_refused(llama_client):
    peer_id = _peer(llama_client, 0)

    async def call():
        stub = StageService.get_stub(llama_client.node.p2p, PeerID.from_base58(peer_id))

        async def requests():
            for message in tensor_messages(torch.randn(1, 2, 64), b"\xc1 not msgpack"):
                yield message

        first = await anext(await stub.rpc_forward(requests()))
        return ForwardReply.from_bytes(first.metadata).error

    error = llama_client._loop.run(call())
    assert "malformed ForwardRequest" in error
    _assert_still_serving(llama_client)


def test_truncated_stream_is_refused(llama_client):
    """A client that sends the first chunk of a multi-chunk tensor and then hangs up loses only its request."""
    peer_id = _peer(llama_client, 0)

    async def call():
        stub = StageService.get_stub(llama_client.node.p2p, PeerID.from_base58(peer_id))
        from peers.protocol import ForwardRequest

        messages = list(tensor_messages(torch.randn(4, 1200, 64), ForwardRequest(start=0, end=4).to_bytes()))
        assert len(messages) > 1

        async def requests():
            yield messages[0]

        first = await anext(await stub.rpc_forward(requests()))
        return ForwardReply.from_bytes(first.metadata).error

    assert "stream ended after 1 of" in llama_client._loop.run(call())
    _assert_still_serving(llama_client)
