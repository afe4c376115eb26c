"""The encrypted channel: round trips, tampering, replay, reordering, binding to step/aad/session/peer."""

from __future__ import annotations

import os

import pytest

from privacy.channel import ClientHandshake, SecureChannel, accept_handshake, new_session_id
from privacy.errors import ChannelError
from privacy.identity import Identity


def connect(peer: Identity | None = None, session_id: bytes | None = None) -> tuple[SecureChannel, SecureChannel]:
    peer = peer or Identity.generate()
    handshake = ClientHandshake(peer.public_bytes, session_id or new_session_id())
    reply, server = accept_handshake(handshake.hello(), peer)
    return handshake.finish(reply), server


@pytest.mark.parametrize("size", [0, 1, 1000, 65536 + 3, 4 << 20])
def test_round_trip_both_directions(size):
    client, server = connect()
    for step in range(3):
        data = os.urandom(size)
        sealed = client.seal(data, step=step, aad=b"forward")
        assert len(sealed) == size + 24 and (size < 64 or data not in sealed)
        assert server.open(sealed, step=step, aad=b"forward") == data
        answer = os.urandom(size)
        assert client.open(server.seal(answer, step=step), step=step) == answer
    assert client.binding == server.binding and client.session_id == server.session_id


@pytest.mark.parametrize("where", ["header", "body", "tag"])
def test_tampered_message_refused_and_session_survives(where):
    client, server = connect()
    sealed = client.seal(b"activations" * 100, step=7)
    index = {"header": 7, "body": 8 + 50, "tag": len(sealed) - 1}[where]
    tampered = bytearray(sealed)
    tampered[index] ^= 0x01
    with pytest.raises(ChannelError, match="authentication"):  # a forged counter is authenticated too
        server.open(bytes(tampered), step=7)
    with pytest.raises(ChannelError, match="too short|shorter"):
        server.open(sealed[:20], step=7)
    assert server.open(sealed, step=7) == b"activations" * 100
    assert server.open(client.seal(b"next", step=8), step=8) == b"next"


def test_replay_refused():
    client, server = connect()
    sealed = client.seal(b"hello", step=0)
    server.open(sealed, step=0)
    with pytest.raises(ChannelError, match="replayed or reordered"):
        server.open(sealed, step=0)
    assert server.open(client.seal(b"again", step=1), step=1) == b"again"


def test_reorder_refused():
    """The message that arrives after a later one is refused; a gap (a lost message) is not fatal."""
    client, server = connect()
    first, second, third = client.seal(b"1", step=0), client.seal(b"2", step=1), client.seal(b"3", step=2)
    assert server.open(second, step=1) == b"2"
    with pytest.raises(ChannelError, match="replayed or reordered"):
        server.open(first, step=0)
    assert server.open(third, step=2) == b"3"


def test_wrong_step_or_aad_refused():
    client, server = connect()
    sealed = client.seal(b"x", step=3, aad=b"rpc_forward")
    with pytest.raises(ChannelError, match="authentication"):
        server.open(sealed, step=4, aad=b"rpc_forward")
    with pytest.raises(ChannelError, match="authentication"):
        server.open(sealed, step=3, aad=b"rpc_backward")
    assert server.open(sealed, step=3, aad=b"rpc_forward") == b"x"
    with pytest.raises(ChannelError, match="step must be an integer"):
        client.seal(b"x", step=True)


def test_reflected_message_refused():
    client, _ = connect()
    with pytest.raises(ChannelError, match="authentication"):
        client.open(client.seal(b"reflected", step=0), step=0)


def test_wrong_peer_identity_refused():
    expected, impostor = Identity.generate(), Identity.generate()
    handshake = ClientHandshake(expected.public_bytes, new_session_id())
    reply, _ = accept_handshake(handshake.hello(), impostor)
    with pytest.raises(ChannelError, match="is not the peer its record names"):
        handshake.finish(reply)
    with pytest.raises(ChannelError, match="malformed"):
        handshake.finish(reply[:-1])
    with pytest.raises(ChannelError, match="malformed"):
        accept_handshake(b"garbage", expected)


def test_different_sessions_get_different_keys():
    peer = Identity.generate()
    session_id = new_session_id()
    client_a, server_a = connect(peer, session_id)
    client_b, server_b = connect(peer, session_id)  # same peer and session id, fresh ephemerals
    assert client_a.binding != client_b.binding
    sealed = client_a.seal(b"secret", step=0)
    with pytest.raises(ChannelError, match="authentication"):
        server_b.open(sealed, step=0)
    assert server_a.open(sealed, step=0) == b"secret"
    assert client_a.seal(b"same", step=0)[8:] != client_b.seal(b"same", step=0)[8:]
