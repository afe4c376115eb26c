"""A peer's cache shared between clients, on real processes: a share per client, and a wait for space."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator

import pytest
import torch

from peers.cli.launch import LocalSwarm
from peers.client.inference_session import SpanSession
from peers.client.swarm_client import SwarmClient
from peers.wire.errors import CAPACITY_REFUSAL, RequestError

CACHE_TOKENS, SHARE = 200, 100  # --client_cache_share 0.5
CACHE_WAIT = 20.0  # longer than the test needs: a waiting open is ended by a close, never by this


@pytest.fixture(scope="module")
def shared_peer(llama_dir, tmp_path_factory) -> Iterator[tuple[LocalSwarm, str]]:
    with LocalSwarm(tmp_path_factory.mktemp("fairness"), update_period=2.0) as swarm:
        swarm.start_dht()
        peer = swarm.start_peer(llama_dir, block_indices="0:8", extra=[
            "--cache_tokens", str(CACHE_TOKENS), "--client_cache_share", "0.5", "--cache_wait", str(CACHE_WAIT)])
        yield swarm, peer.peer_id


def _span(client: SwarmClient, peer_id: str) -> SpanSession:
    return SpanSession(client, peer_id, 0, 8, secrets.token_hex(8))


def _open(client: SwarmClient, peer_id: str, max_length: int = 50) -> SpanSession:
    span = _span(client, peer_id)
    client.loop.run(span.open(max_length, 1))
    return span


def _refused(client: SwarmClient, peer_id: str) -> str:
    with pytest.raises(RequestError) as refused:
        _open(client, peer_id)
    message = str(refused.value)
    assert f"refused the session: {CAPACITY_REFUSAL}" in message, message
    return message


def test_finding_11_a_client_beyond_its_share_yields_to_another(shared_peer, llama_dir):
    swarm, peer_id = shared_peer
    a = SwarmClient(llama_dir, initial_peers=swarm.initial_peers)
    b = SwarmClient(llama_dir, initial_peers=swarm.initial_peers)
    try:
        held = [_open(a, peer_id) for _ in range(4)]  # A alone borrows the whole cache
        assert a.info(peer_id).cache_tokens_free == 0

        # B's open waits for space (its stream has no live session that a wait would hold back)
        waiting = _span(b, peer_id)
        opened = asyncio.run_coroutine_threadsafe(waiting.open(50, 1), b.loop.loop)
        deadline = time.monotonic() + 15
        while a.info(peer_id).opens_waiting != 1:
            assert time.monotonic() < deadline and not opened.done(), "B's open did not wait for space"
            time.sleep(0.1)
        message = _refused(a, peer_id)  # no waiting on A's stream: its sessions' steps would wait behind
        assert f"this client already holds {CACHE_TOKENS} of {CACHE_TOKENS} cache tokens (its share is {SHARE})" \
            in message
        a.loop.run(held.pop().close())
        opened.result(timeout=30)  # the space A freed went to B's waiting open
        assert b.loop.run(waiting.step(torch.randn(1, 3, 64))).shape == (1, 3, 64)

        # B is turned away while A holds 150; once A is back at its share, the freed space is B's, not A's
        assert "cache full" in _refused(b, peer_id)
        a.loop.run(held.pop().close())
        assert f"(its share is {SHARE})" in _refused(a, peer_id)
        second = _open(b, peer_id)
        info = a.info(peer_id)
        assert (info.cache_tokens_free, info.sessions, info.opens_waiting) == (0, 4, 0)
        for client, span in [(a, held[0]), (a, held[1]), (b, waiting), (b, second)]:
            client.loop.run(span.close())
    finally:
        a.close()
        b.close()
