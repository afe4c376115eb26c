"""Streams between a client and a peer: idle ones stay open, dead or frozen peers are noticed at once, oversized
frames are refused on arrival, and a stream without a hello gets nothing (issue 15, findings 2, 3, 4, 8, 10)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import pytest
import torch
from hivemind.p2p import PeerID

from peers.cli.launch import LocalSwarm
from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig, SwarmConfig
from peers.training import OptimConfig
from peers.wire.framing import ERROR, MESSAGE, read_frame
from peers.wire.messages import InferenceOpen, TrainOpen, pack_inference
from peers.wire.service import INFERENCE_HANDLE
from peers.wire.stream import PeerStream


@pytest.fixture(scope="module")
def quick_peer(llama_dir, tmp_path_factory) -> Iterator[tuple[LocalSwarm, object]]:
    """One peer for blocks 0:8 whose request deadline is 3 s (the old code ended a stream idle for that long)."""
    with LocalSwarm(tmp_path_factory.mktemp("quick_peer"), update_period=2.0) as swarm:
        swarm.start_dht()
        proc = swarm.start_peer(llama_dir, block_indices="0:8", extra=["--request_timeout", "3"])
        yield swarm, proc


@pytest.fixture(scope="module")
def quick_client(quick_peer, llama_dir) -> Iterator[SwarmClient]:
    swarm, _ = quick_peer
    config = ClientConfig(swarm=SwarmConfig(initial_peers=tuple(swarm.initial_peers)), request_timeout=60.0)
    with SwarmClient(llama_dir, config=config) as client:
        client.wait_for_records(1)
        yield client


def test_finding_03_idle_stream_stays_open(quick_peer, quick_client):
    """A stream idle for longer than the peer's request deadline is still open and carries the next request."""
    _, proc = quick_peer

    async def go():
        stream = await quick_client.peer_stream(proc.peer_id)
        await stream.forward(0, 8, torch.randn(1, 3, 64), timeout=30)
        await asyncio.sleep(7.0)  # more than twice the peer's 3 s deadline
        assert not stream.closed, "the peer ended an idle stream"
        out = await stream.forward(0, 8, torch.randn(1, 3, 64), timeout=30)
        return stream is await quick_client.peer_stream(proc.peer_id), out.shape

    same, shape = quick_client.loop.run(go())
    assert same and shape == (1, 3, 64)


def test_finding_10_malformed_frame_is_one_log_line(quick_peer, quick_client):
    """Garbage on the stream closes that stream with one warning; no traceback in the peer's log."""
    _, proc = quick_peer

    async def go():
        _, reader, writer = await quick_client.node.p2p.call_binary_stream_handler(
            PeerID.from_base58(proc.peer_id), INFERENCE_HANDLE)
        writer.write(b"\x07garbage that is not a frame")
        await writer.drain()
        frame = await asyncio.wait_for(read_frame(reader), 10)
        writer.close()
        return frame

    marker, _ = quick_client.loop.run(go())
    assert marker == ERROR
    time.sleep(0.5)
    log = proc.log()
    assert "unknown frame marker" in log and "Traceback" not in log
    assert quick_client.forward(torch.tensor([[1, 2, 3]])).shape[:2] == (1, 3)


def test_finding_08_oversized_frame_refused_on_arrival(quick_peer, quick_client):
    """A frame that declares 2^40 bytes is refused when its header arrives, not after the peer buffered it."""
    _, proc = quick_peer

    async def go():
        _, reader, writer = await quick_client.node.p2p.call_binary_stream_handler(
            PeerID.from_base58(proc.peer_id), INFERENCE_HANDLE)
        writer.write(MESSAGE + (1 << 40).to_bytes(8, "big") + bytes(4096))  # then keep the stream open
        await writer.drain()
        try:
            return await asyncio.wait_for(read_frame(reader), 10)  # the old peer waits for the rest: times out
        finally:
            writer.close()

    marker, payload = quick_client.loop.run(go())
    assert marker == ERROR and b"exceeds the limit" in payload
    assert quick_client.forward(torch.tensor([[1, 2, 3]])).shape[:2] == (1, 3)


def test_finding_02_no_session_or_run_without_hello(quick_peer, quick_client):
    """A stream that skipped the hello can neither open an inference session nor a training run."""
    _, proc = quick_peer
    optim = OptimConfig().to_dict()

    async def go():
        stream = await PeerStream.without_hello(quick_client.node.p2p, proc.peer_id)
        try:
            opened = await stream.open(InferenceOpen(session_id="s" * 32, start=0, end=8, max_length=4096,
                                                     batch_size=1), timeout=10)
            trained, _ = await stream._request(pack_inference(TrainOpen(
                run_id="stranger", start=0, end=8, optim=optim, accumulation=1)), None, 10)
            return opened.error, trained.error
        finally:
            stream.shutdown()

    for error in quick_client.loop.run(go()):
        assert "send a hello" in error
    assert quick_client.info(proc.peer_id).sessions == 0


@pytest.fixture
def doomed_peer(llama_dir, tmp_path) -> Iterator[tuple[LocalSwarm, object]]:
    with LocalSwarm(tmp_path, update_period=2.0) as swarm:
        swarm.start_dht()
        yield swarm, swarm.start_peer(llama_dir, block_indices="0:8")


def _client(swarm: LocalSwarm, llama_dir) -> SwarmClient:
    config = ClientConfig(swarm=SwarmConfig(initial_peers=tuple(swarm.initial_peers)), request_timeout=60.0)
    client = SwarmClient(llama_dir, config=config)
    client.wait_for_records(1)
    return client


def test_finding_04_frozen_peer_is_noticed_by_missing_heartbeats(doomed_peer, llama_dir):
    """A peer that stops answering (SIGSTOP: its connection stays up) fails the pending request within a few
    seconds through missing heartbeats, not at the 60 s request deadline."""
    swarm, proc = doomed_peer
    with _client(swarm, llama_dir) as client:
        async def go():
            stream = await client.peer_stream(proc.peer_id)
            await stream.forward(0, 8, torch.randn(1, 3, 64), timeout=60)
            os.killpg(proc.pid, signal.SIGSTOP)
            try:
                await stream.forward(0, 8, torch.randn(1, 3, 64), timeout=60)
            finally:
                os.killpg(proc.pid, signal.SIGCONT)

        with pytest.raises(ConnectionError, match="sent nothing for"):
            client.loop.run(go(), timeout=50)


def test_finding_04_killed_peer_fails_the_pending_request_at_once(doomed_peer, llama_dir):
    """A peer killed while a request waits for it closes the stream, which fails the request at once."""
    swarm, proc = doomed_peer
    with _client(swarm, llama_dir) as client:
        async def go():
            stream = await client.peer_stream(proc.peer_id)
            await stream.forward(0, 8, torch.randn(1, 3, 64), timeout=60)
            os.kill(proc.pid, signal.SIGSTOP)  # the peer process only; its p2p daemon keeps the connection
            pending = asyncio.ensure_future(stream.forward(0, 8, torch.randn(1, 3, 64), timeout=60))
            await asyncio.sleep(0.5)
            os.kill(proc.pid, signal.SIGKILL)
            await pending

        with pytest.raises(ConnectionError, match="closed the stream|broke"):
            client.loop.run(go(), timeout=50)


def test_finding_08_streams_per_caller_are_bounded(quick_peer, quick_client):
    """Each stream may hold an unfinished frame, so one caller's streams are bounded; the others' are not hurt."""
    from peers.server.stream_handler import MAX_STREAMS_PER_CALLER

    _, proc = quick_peer

    async def go():
        opened, refusal = [], None
        try:
            for _ in range(MAX_STREAMS_PER_CALLER + 1):
                _, reader, writer = await quick_client.node.p2p.call_binary_stream_handler(
                    PeerID.from_base58(proc.peer_id), INFERENCE_HANDLE)
                opened.append(writer)
                try:
                    refusal = await asyncio.wait_for(read_frame(reader), 0.5)
                    break
                except asyncio.TimeoutError:
                    continue
        finally:
            for writer in opened:
                writer.close()
        return len(opened), refusal

    count, (marker, payload) = quick_client.loop.run(go())
    assert marker == ERROR and b"too many streams" in payload and count <= MAX_STREAMS_PER_CALLER + 1
    time.sleep(1.0)
    assert quick_client.forward(torch.tensor([[1, 2, 3]])).shape[:2] == (1, 3)
