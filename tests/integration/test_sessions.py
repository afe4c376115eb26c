"""Inference sessions under bad input: clear errors or clean release, no leak, other sessions unaffected."""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch

from peers.cli.launch import LocalSwarm
from peers.client.inference_session import SpanSession
from peers.client.swarm_client import SwarmClient
from peers.model import LocalModel
from peers.wire.errors import RequestError

CACHE_TOKENS, TIMEOUT = 200, 2.0


@pytest.fixture(scope="module")
def small_peer(llama_dir, tmp_path_factory) -> Iterator[tuple[LocalSwarm, str]]:
    """One peer with all 8 blocks, a 200-token cache budget and a 2 s session timeout.

    An open that does not fit is refused at once (``--cache_wait 0``): a wait as long as the timeout would end with
    the idle session that filled the cache reaped. Waiting for space is tested in ``test_sessions_fairness.py``.
    """
    with LocalSwarm(tmp_path_factory.mktemp("sessions"), update_period=2.0) as swarm:
        swarm.start_dht()
        peer = swarm.start_peer(llama_dir, block_indices="0:8", extra=[
            "--cache_tokens", str(CACHE_TOKENS), "--session_timeout", str(TIMEOUT), "--cache_wait", "0"])
        yield swarm, peer.peer_id


@pytest.fixture(scope="module")
def two_clients(small_peer, llama_dir) -> Iterator[tuple[SwarmClient, SwarmClient]]:
    swarm, _ = small_peer
    a = SwarmClient(llama_dir, initial_peers=swarm.initial_peers)
    b = SwarmClient(llama_dir, initial_peers=swarm.initial_peers)
    yield a, b
    a.close()
    b.close()


def _open(client, peer_id, *, max_length=20, session_id=None) -> SpanSession:
    span = SpanSession(client, peer_id, 0, 8, session_id or secrets.token_hex(8))
    client.loop.run(span.open(max_length, 1))
    return span


def _free(client, peer_id) -> int:
    return client.info(peer_id).cache_tokens_free


def _wait_free(client, peer_id, expected, timeout=15.0) -> None:
    deadline = time.monotonic() + timeout
    while _free(client, peer_id) != expected:
        assert time.monotonic() < deadline, f"cache not freed: {_free(client, peer_id)} != {expected}"
        time.sleep(0.2)


def test_step_beyond_max_length_is_refused_and_session_continues(two_clients, small_peer, llama_dir):
    a, _ = two_clients
    peer_id = small_peer[1]
    span = _open(a, peer_id, max_length=6)
    model = LocalModel.from_dir(llama_dir)
    hidden = torch.randn(1, 4, 64)
    out = a.loop.run(span.step(hidden))
    with pytest.raises(RequestError, match="beyond the session's max_length 6"):
        a.loop.run(span.step(torch.randn(1, 3, 64)))
    last = torch.randn(1, 2, 64)
    out2 = a.loop.run(span.step(last))  # still usable, cache intact
    expected, _ = model.blocks(torch.cat([hidden, last], 1), torch.arange(6)[None])
    assert (torch.cat([out, out2], 1) - expected).abs().max() < 1e-4
    a.loop.run(span.close())
    _wait_free(a, peer_id, CACHE_TOKENS, timeout=5)


def test_unknown_session_id_is_refused(two_clients, small_peer):
    a, _ = two_clients
    with pytest.raises(RequestError, match="unknown session id"):
        _open_resume(a, small_peer[1], "no-such-session")


def _open_resume(client, peer_id, session_id):
    span = SpanSession(client, peer_id, 0, 8, session_id)
    client.loop.run(span.open(20, 1, resume=True))
    return span


def test_session_of_another_client_is_refused(two_clients, small_peer):
    a, b = two_clients
    peer_id = small_peer[1]
    span = _open(a, peer_id)
    a.loop.run(span.step(torch.randn(1, 3, 64)))
    with pytest.raises(RequestError, match="already used by another client"):
        _open(b, peer_id, session_id=span.session_id)
    span.abandon()  # a's stream breaks; the session waits for a resume
    time.sleep(0.5)
    with pytest.raises(RequestError, match="belongs to another client"):
        _open_resume(b, peer_id, span.session_id)
    resumed = _open_resume(a, peer_id, span.session_id)  # the owner may re-attach
    assert a.loop.run(resumed.step_at(3, torch.randn(1, 1, 64))).shape == (1, 1, 64)
    a.loop.run(resumed.close())
    _wait_free(a, peer_id, CACHE_TOKENS, timeout=5)


def test_cache_full_is_refused_and_closing_frees_at_once(two_clients, small_peer):
    a, b = two_clients
    peer_id = small_peer[1]
    first = _open(a, peer_id, max_length=150)
    assert _free(a, peer_id) == CACHE_TOKENS - 150
    with pytest.raises(RequestError, match="cache full"):
        _open(b, peer_id, max_length=100)
    a.loop.run(first.close())
    _wait_free(a, peer_id, CACHE_TOKENS, timeout=5)
    second = _open(b, peer_id, max_length=100)
    b.loop.run(second.close())


def test_vanished_client_is_freed_after_timeout(two_clients, small_peer, llama_dir):
    a, _ = two_clients
    swarm, peer_id = small_peer
    script = (
        "import sys, time, torch, secrets\n"
        "from peers.client.swarm_client import SwarmClient\nfrom peers.client.inference_session import SpanSession\n"
        f"c = SwarmClient({str(llama_dir)!r}, initial_peers={swarm.initial_peers!r})\n"
        f"s = SpanSession(c, {peer_id!r}, 0, 8, secrets.token_hex(8))\n"
        "c.loop.run(s.open(120, 1)); c.loop.run(s.step(torch.randn(1, 5, 64)))\n"
        "print('OPEN', flush=True); time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "OPEN"
        other = _open(a, peer_id, max_length=20)  # another session keeps working throughout
        assert _free(a, peer_id) == CACHE_TOKENS - 140
        import os
        import signal

        os.killpg(proc.pid, signal.SIGKILL)  # the client and its p2p daemon vanish mid-session
        proc.wait(10)
        deadline = time.monotonic() + 5 * TIMEOUT + 10
        while _free(a, peer_id) != CACHE_TOKENS - 20:  # the other session stays active meanwhile
            assert time.monotonic() < deadline, "the vanished client's cache was not freed"
            assert a.loop.run(other.step_at(0, torch.randn(1, 2, 64))).shape == (1, 2, 64)
            time.sleep(0.3)
        a.loop.run(other.close())
        _wait_free(a, peer_id, CACHE_TOKENS, timeout=5)
    finally:
        if proc.poll() is None:
            import os
            import signal

            os.killpg(proc.pid, signal.SIGKILL)


def test_idle_session_is_freed(two_clients, small_peer):
    a, _ = two_clients
    peer_id = small_peer[1]
    span = _open(a, peer_id, max_length=50)
    assert _free(a, peer_id) == CACHE_TOKENS - 50
    _wait_free(a, peer_id, CACHE_TOKENS, timeout=5 * TIMEOUT)
    with pytest.raises((RequestError, ConnectionError), match="idle|closed"):
        a.loop.run(span.step(torch.randn(1, 1, 64)))


def test_steps_of_two_sessions_share_a_message_and_fail_independently(two_clients, small_peer, llama_dir):
    """Concurrent steps of one client's sessions travel together; a refused part leaves the other intact."""
    a, _ = two_clients
    peer_id = small_peer[1]
    good, bad = _open(a, peer_id, max_length=10), _open(a, peer_id, max_length=3)
    model = LocalModel.from_dir(llama_dir)
    x_good, x_bad = torch.randn(1, 4, 64), torch.randn(1, 4, 64)  # 4 tokens exceed bad's max_length 3
    before = a.info(peer_id).inference_batches
    stream = a.loop.run(a.peer_stream(peer_id))
    messages = stream.step_messages

    async def both():
        return await asyncio.gather(good.step(x_good), bad.step(x_bad), return_exceptions=True)

    out_good, out_bad = a.loop.run(both())
    assert isinstance(out_bad, RequestError) and "beyond the session's max_length 3" in str(out_bad)
    with torch.inference_mode():
        expected, _ = model.blocks(x_good, torch.arange(4)[None])
    assert (out_good - expected).abs().max() < 1e-4
    assert stream.step_messages == messages + 1  # both steps travelled in one message
    assert a.info(peer_id).inference_batches == before + 1  # one forward, for the accepted part only
    assert bad.length == 0 and a.loop.run(bad.step(torch.randn(1, 3, 64))).shape == (1, 3, 64)
    a.loop.run(good.close())
    a.loop.run(bad.close())
    _wait_free(a, peer_id, CACHE_TOKENS, timeout=5)
