"""The peer's stream handler in-process: real blocks and frames over a socket pair, no p2p daemon.

What reaches a peer's handler is a byte stream; these tests write frames into one end of a socket pair, let
``StreamHandler.handle_stream`` serve the other, and read its replies, so each rule is checked without processes.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import torch
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.proto import runtime_pb2
from hivemind.utils.multiaddr import Multiaddr

from peers.model import load_blocks
from peers.server.backend import StageBackend
from peers.server.handler import StageHandler
from peers.server.kv_sessions import SessionRegistry
from peers.wire.framing import MESSAGE, IncomingFrames, encode
from peers.wire.messages import (
    ForwardRequest,
    InferenceClose,
    InferenceHello,
    InferenceOpen,
    InferenceReply,
    InferenceStep,
    StageInfo,
    pack_inference,
)
from peers.wire.tensors import read_tensor_messages, tensor_messages
from privacy.identity import Identity
from privacy.peer_ids import peer_id_of

HIDDEN = 64  # the tiny Llama of tests/conftest.py


def _info(peer_id: str) -> StageInfo:
    return StageInfo(peer_id=peer_id, model="llama-tiny", start=0, end=8, hidden_size=HIDDEN, dtype="float32",
                     max_batch_size=4, max_seq_len=256, max_request_bytes=1 << 20, throughput=1.0, version="test",
                     cache_tokens=512, session_timeout=30.0)


def serve(llama_dir, test: Callable[..., Awaitable[None]]) -> None:
    """Run ``test(request, raw_writer, replies)`` against a handler serving blocks 0:8 of the tiny Llama."""
    torch.manual_seed(0)

    async def go():
        identity = Identity.generate()
        blocks = load_blocks(llama_dir, 0, 8)
        sessions = SessionRegistry(cache_tokens=512, timeout=30.0, max_length_limit=256, cache_wait=0.0)
        backend = StageBackend(blocks, start=0, device=torch.device("cpu"), dtype=torch.float32,
                               active_sessions=sessions.attached_count)
        await backend.launch()
        handler = StageHandler(backend, _info(peer_id_of(identity.public_bytes)), sessions, request_timeout=10.0,
                               identity=identity, require_encryption=False)
        ours, theirs = socket.socketpair()
        server_reader, server_writer = await asyncio.open_unix_connection(sock=theirs)
        caller = peer_id_of(Identity.generate().public_bytes)
        info = StreamInfo(PeerID.from_base58(caller), Multiaddr("/ip4/127.0.0.1/tcp/1"), "test")
        serving = asyncio.create_task(handler.inference.handle_stream(info, server_reader, server_writer))
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        replies = IncomingFrames(reader, runtime_pb2.ExpertResponse)

        async def request(metadata: bytes, tensor: torch.Tensor | None = None):
            frames = [runtime_pb2.ExpertRequest(metadata=metadata)] if tensor is None else \
                list(tensor_messages(tensor, metadata))
            writer.write(b"".join(encode(f) for f in frames))
            await writer.drain()
            first = await asyncio.wait_for(replies.get(), 10)
            assert first is not None, replies.end
            output = None
            if first.tensors:
                _, output = await read_tensor_messages(replies, 1 << 30, first=first)
            return InferenceReply.from_bytes(first.metadata), output

        try:
            await test(request, writer, replies)
        finally:
            writer.close()
            await asyncio.wait_for(serving, 10)
            await backend.shutdown()

    asyncio.run(go())


def _reference(llama_dir, hidden: torch.Tensor) -> torch.Tensor:
    blocks = load_blocks(llama_dir, 0, 8)
    positions = torch.arange(hidden.shape[1]).expand(hidden.shape[0], -1)
    with torch.inference_mode():
        out, _ = blocks(hidden, positions)
    return out


def test_requests_go_to_their_handlers_and_replies_come_in_order(llama_dir):
    hidden = torch.randn(1, 3, HIDDEN)

    async def test(request, *_):
        hello, _ = await request(pack_inference(InferenceHello(heartbeat=False)))
        forward, output = await request(pack_inference(ForwardRequest(start=0, end=8)), hidden)
        opened, _ = await request(pack_inference(InferenceOpen(session_id="a" * 32, start=0, end=8, max_length=16,
                                                               batch_size=1)))
        stepped, step_out = await request(pack_inference(InferenceStep(session_ids=["a" * 32], positions=[0])),
                                          hidden)
        assert hello.error == forward.error == opened.error == stepped.error == ""
        assert stepped.errors == [""]
        torch.testing.assert_close(output, _reference(llama_dir, hidden))
        torch.testing.assert_close(step_out, output)

    serve(llama_dir, test)


def test_a_bad_request_costs_one_reply_not_the_stream(llama_dir):
    async def test(request, *_):
        await request(pack_inference(InferenceHello()))
        for metadata in (b"\x81\xa4kind\x90", b"not msgpack at all", pack_inference(ForwardRequest(start=0, end=9))):
            reply, _ = await request(metadata, torch.randn(1, 2, HIDDEN))
            assert reply.error
        reply, output = await request(pack_inference(ForwardRequest(start=0, end=8)), torch.randn(1, 2, HIDDEN))
        assert reply.error == "" and output.shape == (1, 2, HIDDEN)

    serve(llama_dir, test)


def test_a_close_gets_no_reply_and_frees_the_session(llama_dir):
    async def test(request, *_):
        await request(pack_inference(InferenceHello()))
        await request(pack_inference(InferenceOpen(session_id="b" * 32, start=0, end=8, max_length=16, batch_size=1)))
        await _send_only(request, pack_inference(InferenceClose(session_ids=["b" * 32])))
        reply, _ = await request(pack_inference(InferenceStep(session_ids=["b" * 32], positions=[0])),
                                 torch.randn(1, 1, HIDDEN))
        assert "not open on this stream" in reply.error  # the close's missing reply did not shift this one

    serve(llama_dir, test)


async def _send_only(request, metadata: bytes) -> None:
    """Send a request that gets no reply: the next reply must belong to the next request."""
    task = asyncio.ensure_future(request(metadata))
    await asyncio.sleep(0.2)
    assert not task.done()
    task.cancel()


def test_broken_framing_ends_the_stream_with_its_reason(llama_dir):
    async def test(request, writer, replies):
        await request(pack_inference(InferenceHello()))
        writer.write(MESSAGE + (1 << 40).to_bytes(8, "big"))
        await writer.drain()
        assert await asyncio.wait_for(replies.get(), 10) is None
        assert "exceeds the limit" in replies.end.error

    serve(llama_dir, test)
