"""``peers.wire.framing``: hivemind's frame format, a size cap checked on the header, and a deadline-safe reader."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from peers.wire import activity
from peers.wire.framing import (
    ERROR,
    MESSAGE,
    PIECE_BYTES,
    FrameError,
    IncomingFrames,
    encode,
    end_of_stream,
    read_frame,
)


def _reader(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


def test_frames_are_hiveminds():
    """What we write, hivemind reads, and the other way round."""
    async def go():
        message = runtime_pb2.ExpertRequest(metadata=b"abc")
        theirs, _ = await P2P.receive_protobuf(runtime_pb2.ExpertRequest, _reader(encode(message)))

        class Sink:
            data = b""

            def write(self, chunk):
                Sink.data += bytes(chunk)

            async def drain(self):
                pass

        await P2P.send_protobuf(message, Sink())
        ours = await read_frame(_reader(Sink.data))
        return theirs, ours

    theirs, (marker, payload) = asyncio.run(go())
    assert theirs.metadata == b"abc" and marker == MESSAGE
    assert runtime_pb2.ExpertRequest.FromString(payload).metadata == b"abc"


def test_finding_08_declared_size_is_refused_before_reading_it():
    """A header that declares more than the cap fails at once, with the payload still unread."""
    async def go():
        reader = _reader(MESSAGE + (1 << 40).to_bytes(8, "big") + b"x" * 100, eof=False)
        with pytest.raises(FrameError, match="exceeds the limit"):
            await asyncio.wait_for(read_frame(reader, max_bytes=1 << 20), 5)
        return len(reader._buffer)

    assert asyncio.run(go()) == 100


def test_unknown_marker_and_truncation():
    async def go():
        with pytest.raises(FrameError, match="unknown frame marker"):
            await read_frame(_reader(b"\x05rest"))
        with pytest.raises(asyncio.IncompleteReadError):
            await read_frame(_reader(MESSAGE + (10).to_bytes(8, "big") + b"abc"))
        assert await read_frame(_reader(b"")) is None

    asyncio.run(go())


def test_incoming_frames_survive_cancelled_waits():
    """Waiting for the next message with a deadline loses nothing (hivemind's iterator ended on a timeout)."""
    async def go():
        reader = asyncio.StreamReader()
        frames = IncomingFrames(reader, runtime_pb2.ExpertRequest)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(frames.get(), 0.05)
        reader.feed_data(encode(runtime_pb2.ExpertRequest(metadata=b"one")))
        first = await asyncio.wait_for(frames.get(), 5)
        reader.feed_data(encode(runtime_pb2.ExpertRequest(metadata=b"two")) + end_of_stream())
        second = await frames.get()
        end = await frames.get()
        return first.metadata, second.metadata, end, frames.end

    first, second, end, how = asyncio.run(go())
    assert (first, second, end) == (b"one", b"two", None) and how.error == ""


def test_error_frame_and_broken_framing_end_the_stream_with_a_reason():
    async def go():
        from hivemind.proto.p2pd_pb2 import RPCError

        said = IncomingFrames(_reader(encode(RPCError(message="peer is sad"), ERROR)), runtime_pb2.ExpertRequest)
        assert await said.get() is None
        broken = IncomingFrames(_reader(MESSAGE + (1 << 40).to_bytes(8, "big")), runtime_pb2.ExpertRequest)
        assert await broken.get() is None
        undecodable = IncomingFrames(_reader(MESSAGE + (3).to_bytes(8, "big") + b"\xff\xff\xff"),
                                     runtime_pb2.ExpertRequest)
        assert await undecodable.get() is None
        return said.end.error, broken.end.error, undecodable.end.error

    said, broken, undecodable = asyncio.run(go())
    assert said == "peer is sad" and "exceeds the limit" in broken and "undecodable" in undecodable


def test_finding_08_unfinished_body_is_dropped_after_its_deadline(monkeypatch):
    """A sender that stalls inside a frame's body cannot pin its memory for long: the frame fails on a deadline."""
    import peers.wire.framing as framing

    monkeypatch.setattr(framing, "BODY_GRACE", 0.2)
    monkeypatch.setattr(framing, "BODY_MIN_RATE", 1 << 30)

    async def go():
        reader = _reader(MESSAGE + (1000).to_bytes(8, "big") + b"x" * 999, eof=False)  # one byte short, forever
        with pytest.raises(FrameError, match="did not arrive within"):
            await asyncio.wait_for(read_frame(reader), 5)

    asyncio.run(go())


def test_largest_legitimate_frame_fits_the_cap():
    """A chunk of a big tensor with the largest metadata a message may have stays under the frame cap."""
    import torch

    from peers.wire.framing import MAX_FRAME_BYTES
    from peers.wire.tensors import tensor_messages
    from peers.wire.values import MAX_MESSAGE_BYTES

    metadata = b"m" * MAX_MESSAGE_BYTES
    frames = [encode(m) for m in tensor_messages(torch.randn(3, 1 << 19), metadata)]
    assert len(frames) > 1 and max(map(len, frames)) <= MAX_FRAME_BYTES


def test_a_long_frame_is_a_sign_of_life_before_it_ends():
    """While a long frame arrives, its sender counts as heard from (``peers.wire.activity``), on every stream of
    this process: a reply stuck behind that peer's bulk data elsewhere does not make it look gone."""
    peer = "12D3KooW" + "L" * 44
    body = encode(runtime_pb2.ExpertRequest(metadata=b"x" * (3 * PIECE_BYTES)))

    async def go():
        reader = asyncio.StreamReader()
        frames = IncomingFrames(reader, runtime_pb2.ExpertRequest, peer=peer)
        reader.feed_data(body[: len(body) // 2])  # half of the frame: no message yet
        await asyncio.sleep(0.05)
        half = (activity.last_heard(peer), frames.last_frame, frames.queued)
        reader.feed_data(body[len(body) // 2:])
        message = await asyncio.wait_for(frames.get(), 5)
        return half, len(message.metadata)

    (heard, last, queued), size = asyncio.run(go())
    assert heard > 0 and last == heard and queued == 0  # heard from, although no message has come yet
    assert size == 3 * PIECE_BYTES


def test_activity_forgets_the_oldest_peer_first(monkeypatch):
    monkeypatch.setattr(activity, "MAX_PEERS", 3)
    monkeypatch.setattr(activity, "_heard", {})
    for k, peer in enumerate("abcd"):
        activity.heard(peer, float(k + 1))
    activity.heard("", 9.0)  # no peer id: nothing kept
    assert [activity.last_heard(p) for p in "abcd"] == [0.0, 2.0, 3.0, 4.0]
