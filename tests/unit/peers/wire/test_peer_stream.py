"""``PeerStream`` in-process, against a fake peer over a socket pair: steps that wait while another is in flight
leave together in one message, each session gets its own rows back, and a peer that goes away fails what waits."""

from __future__ import annotations

import asyncio
import socket

import torch
from hivemind.proto import runtime_pb2

from peers.wire.errors import RequestError
from peers.wire.framing import IncomingFrames, encode
from peers.wire.messages import InferenceReply, InferenceStep, unpack_inference
from peers.wire.stream import PeerStream
from peers.wire.tensors import read_tensor_messages, tensor_messages

PEER = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


async def _pair():
    ours, theirs = socket.socketpair()
    client = await asyncio.open_unix_connection(sock=ours)
    peer = await asyncio.open_unix_connection(sock=theirs)
    return client, peer


async def _fake_peer(reader, writer, seen: list[InferenceStep], delay: float) -> None:
    """Answers each step with its input plus 1, after ``delay`` seconds; notes every step message it got."""
    requests = IncomingFrames(reader, runtime_pb2.ExpertRequest)
    while (first := await requests.get()) is not None:
        step = unpack_inference(first.metadata)
        _, hidden = await read_tensor_messages(requests, 1 << 30, first=first)
        seen.append(step)
        await asyncio.sleep(delay)
        reply = InferenceReply(errors=[""] * len(step.session_ids)).to_bytes()
        writer.write(b"".join(encode(m) for m in tensor_messages(hidden + 1, reply, runtime_pb2.ExpertResponse)))
        await writer.drain()
    writer.close()


def test_concurrent_steps_travel_together_and_come_back_to_their_sessions():
    async def go():
        (reader, writer), (peer_reader, peer_writer) = await _pair()
        seen: list[InferenceStep] = []
        peer = asyncio.create_task(_fake_peer(peer_reader, peer_writer, seen, delay=0.2))
        stream = PeerStream(None, PEER)
        stream._start(reader, writer)
        inputs = [torch.full((1, 1, 4), float(i)) for i in range(4)]
        first = asyncio.ensure_future(stream.step("s0", 0, inputs[0], timeout=10))
        await asyncio.sleep(0.05)  # s0 is in flight: the next three wait and leave together
        rest = [asyncio.ensure_future(stream.step(f"s{i}", 0, inputs[i], timeout=10)) for i in (1, 2, 3)]
        outputs = await asyncio.gather(first, *rest)
        stream.shutdown()
        await asyncio.wait_for(peer, 10)
        return seen, outputs, stream.step_messages

    seen, outputs, messages = asyncio.run(go())
    assert [s.session_ids for s in seen] == [["s0"], ["s1", "s2", "s3"]] and messages == 2
    assert [o.flatten()[0].item() for o in outputs] == [1.0, 2.0, 3.0, 4.0]


def test_two_waiting_steps_of_one_session_leave_in_order_one_per_message():
    """A replay queued next to the step that follows it (the chain after a recovery): never one message with the
    same session twice, which the peer refuses."""
    async def go():
        (reader, writer), (peer_reader, peer_writer) = await _pair()
        seen: list[InferenceStep] = []
        peer = asyncio.create_task(_fake_peer(peer_reader, peer_writer, seen, delay=0.1))
        stream = PeerStream(None, PEER)
        stream._start(reader, writer)
        first = asyncio.ensure_future(stream.step("other", 0, torch.zeros(1, 1, 4), timeout=10))
        await asyncio.sleep(0.05)
        waiting = [asyncio.ensure_future(stream.step(sid, pos, torch.full((1, 1, 4), float(i)), timeout=10))
                   for i, (sid, pos) in enumerate([("s", 0), ("s", 1), ("t", 0)])]
        outputs = await asyncio.gather(first, *waiting)
        stream.shutdown()
        await asyncio.wait_for(peer, 10)
        return seen, outputs

    seen, outputs = asyncio.run(go())
    assert [(s.session_ids, s.positions) for s in seen] == [(["other"], [0]), (["s", "t"], [0, 0]), (["s"], [1])]
    assert [o.flatten()[0].item() for o in outputs[1:]] == [1.0, 2.0, 3.0]


def test_a_peer_that_goes_away_fails_every_pending_step_at_once():
    async def go():
        (reader, writer), (peer_reader, peer_writer) = await _pair()
        stream = PeerStream(None, PEER)
        stream._start(reader, writer)
        pending = [asyncio.ensure_future(stream.step(f"s{i}", 0, torch.zeros(1, 1, 4), timeout=60)) for i in range(3)]
        await asyncio.sleep(0.1)
        peer_writer.close()  # the peer's end closes, as when its process dies
        results = await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 5)
        return results, stream.closed

    results, closed = asyncio.run(go())
    assert closed and all(isinstance(r, ConnectionError) for r in results), results


async def _timed_peer(reader, writer, replies: list[InferenceReply], delay: float) -> None:
    """Answers each request with the next of ``replies`` (and the request's tensor back), after ``delay`` s."""
    requests = IncomingFrames(reader, runtime_pb2.ExpertRequest)
    for reply in replies:
        first = await requests.get()
        if first is None:
            break
        _, hidden = await read_tensor_messages(requests, 1 << 30, first=first)
        await asyncio.sleep(delay)
        writer.write(b"".join(encode(m) for m in tensor_messages(hidden, reply.to_bytes(), runtime_pb2.ExpertResponse)))
        await writer.drain()
    writer.close()


def test_the_observer_gets_wall_time_and_the_peers_reported_compute():
    """Passive link samples: only for replies that report the peer's time, without an error, to requests that had
    the stream to themselves (one queued behind another would count the other's compute as network)."""
    replies = [InferenceReply(compute_ms=30.0), InferenceReply(), InferenceReply(error="no", compute_ms=5.0),
               InferenceReply(compute_ms=30.0), InferenceReply(compute_ms=30.0)]
    samples = []

    async def go():
        (reader, writer), (peer_reader, peer_writer) = await _pair()
        peer = asyncio.create_task(_timed_peer(peer_reader, peer_writer, replies, delay=0.04))
        stream = PeerStream(None, PEER, observe=lambda *sample: samples.append(sample))
        stream._start(reader, writer)
        for _ in range(3):
            try:
                await stream.call(InferenceStep(session_ids=["s"], positions=[0]), torch.zeros(1, 1, 4), 10)
            except RequestError:  # the third: refused
                pass
        await asyncio.gather(*(stream.call(InferenceStep(session_ids=["s"], positions=[0]), torch.zeros(1, 1, 4), 10)
                               for _ in range(2)))  # the second waits behind the first
        stream.shutdown()
        await asyncio.wait_for(peer, 10)

    asyncio.run(go())
    assert len(samples) == 2, samples  # the first call, and the first of the two sent together
    for peer_id, wall, compute, nbytes in samples:
        assert peer_id == PEER and compute == 0.03 and wall >= 0.04 and 2 * 16 < nbytes < 400
