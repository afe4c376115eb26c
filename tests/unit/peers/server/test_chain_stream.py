"""The chain on one peer's handler in-process (two streams over socket pairs, no daemon): a step that waits for its
input from the upstream peer is deferred (the stream goes on, replies stay in order), and pushes are accepted only
from the upstream the client named."""

from __future__ import annotations

import asyncio
import socket

import torch
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.proto import runtime_pb2
from hivemind.utils.multiaddr import Multiaddr

from peers.model import load_blocks
from peers.server.backend import StageBackend
from peers.server.handler import StageHandler
from peers.server.kv_sessions import SessionRegistry
from peers.wire.framing import IncomingFrames, encode
from peers.wire.messages import (
    ForwardRequest,
    InferenceClose,
    InferenceHello,
    InferenceOpen,
    InferencePush,
    InferenceRelink,
    InferenceReply,
    InferenceStep,
    StageInfo,
    pack_inference,
)
from peers.wire.tensors import read_tensor_messages, tensor_messages
from privacy.identity import Identity
from privacy.peer_ids import peer_id_of

HIDDEN = 64  # the tiny Llama of tests/conftest.py


class _Stream:
    """One caller's stream into the handler: send requests, read replies in order."""

    def __init__(self, reader, writer) -> None:
        self.writer, self.replies = writer, IncomingFrames(reader, runtime_pb2.ExpertResponse)

    def send(self, message, tensor: torch.Tensor | None = None) -> None:
        metadata = pack_inference(message)
        frames = [runtime_pb2.ExpertRequest(metadata=metadata)] if tensor is None else \
            list(tensor_messages(tensor, metadata))
        self.writer.write(b"".join(encode(f) for f in frames))

    async def reply(self, timeout: float = 10.0) -> tuple[InferenceReply, torch.Tensor | None]:
        first = await asyncio.wait_for(self.replies.get(), timeout)
        assert first is not None, self.replies.end
        output = None
        if first.tensors:
            _, output = await read_tensor_messages(self.replies, 1 << 30, first=first)
        return InferenceReply.from_bytes(first.metadata), output


def _run(llama_dir, test) -> None:
    async def go():
        identity = Identity.generate()
        info = StageInfo(peer_id=peer_id_of(identity.public_bytes), model="llama-tiny", start=0, end=8,
                         hidden_size=HIDDEN, dtype="float32", max_batch_size=4, max_seq_len=256,
                         max_request_bytes=1 << 20, throughput=1.0, version="test", cache_tokens=512)
        sessions = SessionRegistry(cache_tokens=512, timeout=30.0, max_length_limit=256, cache_wait=0.0)
        backend = StageBackend(load_blocks(llama_dir, 0, 8), start=0, device=torch.device("cpu"), dtype=torch.float32,
                               active_sessions=sessions.attached_count)
        await backend.launch()
        handler = StageHandler(backend, info, sessions, request_timeout=10.0, identity=identity,
                               require_encryption=False)
        served, streams = [], {}
        for name in ("client", "upstream", "stranger"):
            ours, theirs = socket.socketpair()
            server_reader, server_writer = await asyncio.open_unix_connection(sock=theirs)
            peer = peer_id_of(Identity.generate().public_bytes)
            stream_info = StreamInfo(PeerID.from_base58(peer), Multiaddr("/ip4/127.0.0.1/tcp/1"), "test")
            served.append(asyncio.create_task(handler.inference.handle_stream(stream_info, server_reader,
                                                                              server_writer)))
            streams[name] = _Stream(*await asyncio.open_unix_connection(sock=ours))
            streams[name].peer_id = peer
            streams[name].send(InferenceHello())
            assert (await streams[name].reply())[0].error == ""
        try:
            await test(streams)
        finally:
            for stream in streams.values():
                stream.writer.close()
            await asyncio.wait_for(asyncio.gather(*served), 10)
            await backend.shutdown()

    asyncio.run(go())


def _reference(llama_dir, hidden: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(hidden.shape[1]).expand(hidden.shape[0], -1)
    with torch.inference_mode():
        out, _ = load_blocks(llama_dir, 0, 8)(hidden, positions)
    return out


def test_a_step_waiting_for_its_push_does_not_hold_up_the_stream(llama_dir):
    hidden = torch.randn(1, 3, HIDDEN)

    async def test(streams):
        client, old, new = streams["client"], streams["upstream"], streams["stranger"]
        client.send(InferenceOpen(session_id="s" * 16, start=0, end=8, max_length=16, batch_size=1,
                                  upstream=old.peer_id))
        assert (await client.reply())[0].error == ""
        client.send(InferenceStep(session_ids=["s" * 16], positions=[0]))  # no tensor: it comes from upstream
        # while the step waits, the stream goes on: the relink (sent after it) is applied, the forward is computed
        client.send(InferenceRelink(session_id="s" * 16, set_upstream=True, upstream=new.peer_id))  # no reply
        client.send(ForwardRequest(start=0, end=8), hidden)  # its reply comes after the step's
        await asyncio.sleep(0.3)
        old.send(InferencePush(session_ids=["s" * 16], positions=[0], rows=[1]), torch.zeros(1, 3, HIDDEN))
        refused, _ = await old.reply()
        assert "is not the upstream of session" in refused.errors[0]  # not any more
        new.send(InferencePush(session_ids=["s" * 16], positions=[0], rows=[1]), hidden)
        acked, _ = await new.reply()
        assert acked.errors == [""]
        stepped, out = await client.reply()
        forwarded, again = await client.reply()
        assert stepped.errors == [""] and forwarded.error == ""
        expected = _reference(llama_dir, hidden)
        torch.testing.assert_close(out, expected)  # the new upstream's input, not the old one's zeros
        torch.testing.assert_close(again, expected)


    _run(llama_dir, test)


def test_a_push_for_a_closed_or_unknown_session_or_of_wrong_rows_is_refused(llama_dir):
    async def test(streams):
        client, upstream = streams["client"], streams["upstream"]
        client.send(InferenceOpen(session_id="t" * 16, start=0, end=8, max_length=4, batch_size=1,
                                  upstream=upstream.peer_id))
        assert (await client.reply())[0].error == ""
        for message, tensor, why in (
            (InferencePush(session_ids=["nope"], positions=[0], rows=[1]), torch.randn(1, 1, HIDDEN), "not open"),
            (InferencePush(session_ids=["t" * 16], positions=[0], rows=[2]), torch.randn(2, 1, HIDDEN), "has 1 rows"),
            (InferencePush(session_ids=["t" * 16], positions=[0], rows=[1]), torch.randn(1, 9, HIDDEN), "max_length"),
            (InferencePush(session_ids=["t" * 16], positions=[3], rows=[1]), torch.randn(1, 1, HIDDEN), "holds 0"),
        ):
            upstream.send(message, tensor)
            got, _ = await upstream.reply()
            assert why in got.errors[0], (got, why)
        upstream.send(InferencePush(session_ids=["t" * 16], positions=[0], rows=[3]), torch.randn(1, 1, HIDDEN))
        assert "do not add up" in (await upstream.reply())[0].error
        client.send(InferenceStep(session_ids=["t" * 16], positions=[0]), torch.randn(1, 1, HIDDEN))
        assert "without a tensor" in (await client.reply())[0].error

    _run(llama_dir, test)


def test_a_step_that_arrives_with_its_sessions_close_does_not_hold_up_the_stream(llama_dir):
    """A client that gives up mid-step (Ctrl-C, an API caller gone) sends the close right behind the step: the
    deferred step must not wait for a push that will never come, holding the stream's later replies."""
    async def test(streams):
        client, upstream = streams["client"], streams["upstream"]
        client.send(InferenceOpen(session_id="u" * 16, start=0, end=8, max_length=8, batch_size=1,
                                  upstream=upstream.peer_id))
        assert (await client.reply())[0].error == ""
        client.send(InferenceStep(session_ids=["u" * 16], positions=[0]))  # waits for its input from upstream
        client.send(InferenceClose(session_ids=["u" * 16]))  # no reply
        client.send(InferenceOpen(session_id="v" * 16, start=0, end=8, max_length=8, batch_size=1))
        stepped, _ = await client.reply(timeout=5.0)  # the peer's request_timeout (10 s) would be too late
        assert "was closed" in (stepped.errors[0] if stepped.errors else stepped.error)
        assert (await client.reply(timeout=5.0))[0].error == ""

    _run(llama_dir, test)
