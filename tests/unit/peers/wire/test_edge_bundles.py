"""Multi-tensor cuts on the wire (issue 18, item 3): a bundle of named edges travels sealed and coded like a hidden
state, and a wrong graph hash, a wrong edge name, shape or dtype, an oversized or reshuffled bundle is refused with
what differs, after the whole bundle was read (the stream stays in step)."""

from __future__ import annotations

import asyncio
import re

import pytest
import torch

from peers.model.graph.trace import EdgeSpec
from peers.wire.edges import edge_messages, read_edge_messages
from peers.wire.errors import RequestError
from peers.wire.tensors import read_tensor_messages, sealer, tensor_messages, unsealer
from privacy.channel import ClientHandshake, accept_handshake, new_session_id
from privacy.errors import ChannelError
from privacy.identity import Identity
from swarm.compression import Codec

HASH = "ab" * 32
SPECS = (EdgeSpec("maxpool", (2, 64, 64, 64), torch.float32), EdgeSpec("mask", (2, 1, 8, 8), torch.bool),
         EdgeSpec("positions", (2, 8), torch.int64))


def bundle() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"maxpool": torch.randn(2, 64, 64, 64, generator=gen), "mask": torch.rand(2, 1, 8, 8, generator=gen) > 0.5,
            "positions": torch.arange(16).reshape(2, 8)}


def channels():
    peer = Identity.generate()
    handshake = ClientHandshake(peer.public_bytes, new_session_id())
    reply, server = accept_handshake(handshake.hello(), peer)
    return handshake.finish(reply), server


def read_then_next(messages, specs=SPECS, graph_hash=HASH, max_bytes=1 << 30, unseal=None):
    """Read one bundle, then the plain tensor that follows it on the same stream (or the bundle's error)."""
    async def go():
        stream = _stream([*messages, *tensor_messages(torch.ones(3), b"next")])
        try:
            result = await read_edge_messages(stream, specs, graph_hash, max_bytes, unseal=unseal)
        except (RequestError, ChannelError) as e:
            result = e
        return result, await read_tensor_messages(stream, 1 << 20)
    return asyncio.run(go())


async def _stream(messages):
    for message in messages:
        yield message


@pytest.mark.parametrize("sealed", [False, True])
def test_a_bundle_arrives_exactly_with_its_context(sealed):
    client, server = channels() if sealed else (None, None)
    sent = bundle()
    messages = list(edge_messages(sent, SPECS, HASH, context=b"step 3", seal=sealer(client)))
    assert len(messages) > 3  # the float edge takes two 1 MiB chunks
    (got, context), after = read_then_next(messages, unseal=unsealer(server))
    assert context == b"step 3" and list(got) == ["maxpool", "mask", "positions"]
    assert all(torch.equal(got[k], sent[k]) and got[k].dtype == sent[k].dtype for k in sent)
    assert after[0] == b"next"


def test_a_codec_codes_float_edges_only():
    sent = bundle()
    (got, _), _ = read_then_next(list(edge_messages(sent, SPECS, HASH, codec=Codec("fp16"))))
    assert got["maxpool"].dtype == torch.float32 and not torch.equal(got["maxpool"], sent["maxpool"])
    assert torch.allclose(got["maxpool"], sent["maxpool"], rtol=1e-3, atol=1e-4)
    assert torch.equal(got["mask"], sent["mask"]) and torch.equal(got["positions"], sent["positions"])


def test_the_sender_refuses_a_wrong_tensor():
    with pytest.raises(ValueError, match=r"missing \['mask'\]"):
        list(edge_messages({k: v for k, v in bundle().items() if k != "mask"}, SPECS, HASH))
    with pytest.raises(ValueError, match=r"edge 'positions' expects \[2, 8\] torch.int64, got \[2, 8\] torch.int32"):
        list(edge_messages({**bundle(), "positions": torch.zeros(2, 8, dtype=torch.int32)}, SPECS, HASH))


def test_the_receiver_refuses_what_does_not_fit_its_cut_and_stays_in_step():
    messages = list(edge_messages(bundle(), SPECS, HASH))
    cases = [
        ({"graph_hash": "cd" * 32}, "graph hash mismatch: the sender traced abababab"),
        ({"specs": (SPECS[0], SPECS[1], EdgeSpec("pos", (2, 8), torch.int64))},
         r"missing \['pos'\], unexpected \['positions'\]"),
        ({"specs": (EdgeSpec("maxpool", (2, 64, 20, 20), torch.float32), *SPECS[1:])},
         r"edge 'maxpool' expects \[2, 64, 20, 20\]"),
        ({"specs": (EdgeSpec("maxpool", (2, 64, 64, 64), torch.float16), *SPECS[1:])}, "expects .* torch.float16"),
        ({"max_bytes": 1 << 20}, "exceeds this peer's limit"),
    ]
    for kwargs, message in cases:
        result, after = read_then_next(messages, **kwargs)
        assert isinstance(result, RequestError) and re.search(message, str(result))
        assert after[0] == b"next" and torch.equal(after[1], torch.ones(3))


def test_tensors_moved_between_edges_are_refused():
    specs = (EdgeSpec("a", (4,), torch.float32), EdgeSpec("b", (4,), torch.float32))
    tensors = {"a": torch.zeros(4), "b": torch.ones(4)}
    plain = list(edge_messages(tensors, specs, HASH))
    result, after = read_then_next(plain[::-1], specs)
    assert isinstance(result, RequestError) and "tensor 0 of the bundle says it is edge 1" in str(result)
    client, server = channels()
    sealed = list(edge_messages(tensors, specs, HASH, seal=sealer(client)))
    sealed[0].tensors[0].buffer, sealed[1].tensors[0].buffer = sealed[1].tensors[0].buffer, sealed[0].tensors[0].buffer
    result, _ = read_then_next(sealed, specs, unseal=unsealer(server))
    assert isinstance(result, ChannelError)  # a sealed tensor is bound to its edge's header
    assert after[0] == b"next"
