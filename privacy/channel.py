"""End-to-end encrypted channel between a client and one stage peer, for serialized tensors.

Handshake (one round trip, the peer is authenticated by its Ed25519 identity, the client stays anonymous)::

    client -> peer:  hello = MAGIC "H" | client X25519 ephemeral (32) | len(session id) (1) | session id
    peer -> client:  reply = MAGIC "R" | peer X25519 ephemeral (32) | Ed25519 signature of (domain, hello, peer eph)

Both sides derive two AES-256-GCM keys (client->peer, peer->client) with HKDF-SHA256 over the X25519 secret,
the info binding the whole transcript (session id, both ephemerals) and the peer's identity key.

A sealed message is ``counter (8, big endian) | ciphertext | tag (16)``. The nonce is direction (4) | counter (8);
the AAD binds session id, direction, counter, step and the caller's aad. The receiver accepts only the next
counter, so messages must be opened in the order they were sealed; a refused message leaves the state untouched.
"""

from __future__ import annotations

import hashlib
import logging
import operator
import os
import threading

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from privacy.errors import ChannelError
from privacy.identity import SIGNATURE_SIZE, Identity, fingerprint, verify_signature

logger = logging.getLogger(__name__)

MAGIC = b"FSC1"
_SIGN_DOMAIN = b"fusionswarm/channel/handshake/v1"
_KDF_DOMAIN = b"fusionswarm/channel/keys/v1"
_AAD_DOMAIN = b"fusionswarm/channel/message/v1"
CLIENT_TO_PEER, PEER_TO_CLIENT = 0, 1
HEADER_SIZE, TAG_SIZE, KEY_SIZE = 8, 16, 32
MAX_COUNTER = (1 << 64) - 1
_HAS_ENCRYPT_INTO = hasattr(AESGCM, "encrypt_into")


def _raw(public: X25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _derive(private: X25519PrivateKey, peer_public: bytes, transcript: bytes) -> tuple[bytes, bytes]:
    try:
        shared = private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as e:  # e.g. a low-order point giving an all-zero secret
        raise ChannelError(f"handshake refused: the other side sent an unusable X25519 key ({e})") from None
    okm = HKDF(hashes.SHA256(), 2 * KEY_SIZE, salt=_KDF_DOMAIN, info=transcript).derive(shared)
    return okm[:KEY_SIZE], okm[KEY_SIZE:]


def _parse_hello(hello: bytes) -> tuple[bytes, bytes]:
    if len(hello) < 38 or hello[:5] != MAGIC + b"H" or len(hello) != 38 + hello[37] or hello[37] == 0:
        raise ChannelError("malformed channel hello: the client runs another protocol version or sent garbage")
    return hello[5:37], hello[38:]


class SecureChannel:
    """One direction-separated AES-256-GCM session; use :meth:`seal` to send and :meth:`open` to receive."""

    def __init__(self, session_id: bytes, send_key: bytes, recv_key: bytes, send_direction: int, binding: bytes):
        self.session_id = bytes(session_id)
        self.binding = binding  # hash of the handshake transcript: put it in membership proof contexts
        self._send_direction, self._recv_direction = send_direction, 1 - send_direction
        self._send_aead, self._recv_aead = AESGCM(send_key), AESGCM(recv_key)
        self._send_counter = self._recv_counter = 0
        self._send_lock, self._recv_lock = threading.Lock(), threading.Lock()
        prefix = _AAD_DOMAIN + len(self.session_id).to_bytes(1, "big") + self.session_id
        self._send_prefix = prefix + send_direction.to_bytes(1, "big")
        self._recv_prefix = prefix + self._recv_direction.to_bytes(1, "big")

    @staticmethod
    def _step_bytes(step: int) -> bytes:
        try:
            if isinstance(step, bool):
                raise TypeError
            return operator.index(step).to_bytes(8, "big", signed=True)
        except (OverflowError, TypeError):
            raise ChannelError(f"step must be an integer fitting in 64 bits, got {step!r}") from None

    def seal(self, plaintext: bytes, *, step: int, aad: bytes = b"") -> bytes:
        """Encrypt ``plaintext`` for the other side; ``step`` and ``aad`` must be given again to :meth:`open`."""
        step_bytes = self._step_bytes(step)
        with self._send_lock:
            counter = self._send_counter
            if counter >= MAX_COUNTER:
                raise ChannelError("channel has sealed 2**64-1 messages; open a new session")
            self._send_counter = counter + 1
        header = counter.to_bytes(HEADER_SIZE, "big")
        nonce = self._send_direction.to_bytes(4, "big") + header
        full_aad = self._send_prefix + header + step_bytes + aad
        if not _HAS_ENCRYPT_INTO:
            return header + self._send_aead.encrypt(nonce, plaintext, full_aad)
        out = bytearray(HEADER_SIZE + len(plaintext) + TAG_SIZE)
        out[:HEADER_SIZE] = header
        self._send_aead.encrypt_into(nonce, plaintext, full_aad, memoryview(out)[HEADER_SIZE:])
        return bytes(out)

    def open(self, ciphertext: bytes, *, step: int, aad: bytes = b"") -> bytes:
        """Decrypt the next message from the other side, or raise :class:`ChannelError` without changing state."""
        step_bytes = self._step_bytes(step)
        if len(ciphertext) < HEADER_SIZE + TAG_SIZE:
            raise ChannelError(f"sealed message is {len(ciphertext)} bytes, shorter than header and tag; "
                               f"it was truncated or not sealed by this channel")
        header = bytes(ciphertext[:HEADER_SIZE])
        counter = int.from_bytes(header, "big")
        nonce = self._recv_direction.to_bytes(4, "big") + header
        with self._recv_lock:
            # counters only move forward: an old counter is a replay or arrived out of order and is refused; a gap
            # (a message lost or refused in transit) is allowed, so that one forgery cannot kill the session
            if counter < self._recv_counter:
                raise ChannelError(f"replayed or reordered message: counter {counter}, expected at least "
                                   f"{self._recv_counter}; messages are opened once each, in the order sealed")
            try:
                plaintext = self._recv_aead.decrypt(nonce, memoryview(ciphertext)[HEADER_SIZE:],
                                                    self._recv_prefix + header + step_bytes + aad)
            except InvalidTag:
                raise ChannelError(f"message failed authentication (counter {counter}, step {step}): it was altered "
                                   f"in transit or sealed for another session, step or aad") from None
            self._recv_counter = counter + 1
        return plaintext


class ClientHandshake:
    """The client's half of the handshake with the peer whose identity key is ``peer_identity_public``."""

    def __init__(self, peer_identity_public: bytes, session_id: bytes):
        if len(peer_identity_public) != 32:
            raise ChannelError("the peer's identity key must be its 32-byte Ed25519 public key")
        if not 1 <= len(session_id) <= 255:
            raise ChannelError(f"session id must be 1 to 255 bytes, got {len(session_id)}")
        self.peer_identity_public, self.session_id = bytes(peer_identity_public), bytes(session_id)
        self._ephemeral: X25519PrivateKey | None = X25519PrivateKey.generate()
        self._hello = MAGIC + b"H" + _raw(self._ephemeral.public_key()) + bytes([len(session_id)]) + self.session_id

    def hello(self) -> bytes:
        return self._hello

    def finish(self, reply: bytes) -> SecureChannel:
        """Check the peer's reply and return the channel; raises ChannelError if the peer is not who we expect."""
        if len(reply) != 5 + 32 + SIGNATURE_SIZE or reply[:5] != MAGIC + b"R":
            raise ChannelError("malformed channel reply: the peer runs another protocol version or sent garbage")
        if self._ephemeral is None:
            raise ChannelError("this handshake was already finished; start a new ClientHandshake per session")
        peer_ephemeral, signature = reply[5:37], reply[37:]
        transcript = self._hello + peer_ephemeral
        if not verify_signature(self.peer_identity_public, _SIGN_DOMAIN + transcript, signature):
            raise ChannelError(f"peer {fingerprint(self.peer_identity_public)} is not the peer its record names: "
                               f"the handshake was not signed by that identity key; do not send it data")
        to_peer, to_client = _derive(self._ephemeral, peer_ephemeral, transcript + self.peer_identity_public)
        self._ephemeral = None  # forward secrecy: forget the ephemeral secret
        binding = hashlib.sha256(transcript + self.peer_identity_public).digest()
        return SecureChannel(self.session_id, to_peer, to_client, CLIENT_TO_PEER, binding)


def accept_handshake(hello: bytes, identity: Identity) -> tuple[bytes, SecureChannel]:
    """The peer's half: answer ``hello`` signed by ``identity``; returns the reply to send and the channel."""
    client_ephemeral, session_id = _parse_hello(bytes(hello))
    ephemeral = X25519PrivateKey.generate()
    transcript = bytes(hello) + _raw(ephemeral.public_key())
    to_peer, to_client = _derive(ephemeral, client_ephemeral, transcript + identity.public_bytes)
    reply = MAGIC + b"R" + transcript[-32:] + identity.sign(_SIGN_DOMAIN + transcript)
    binding = hashlib.sha256(transcript + identity.public_bytes).digest()
    logger.debug("accepted channel session %s", session_id.hex()[:16])
    return reply, SecureChannel(session_id, to_client, to_peer, PEER_TO_CLIENT, binding)


def new_session_id() -> bytes:
    """A random 16-byte session id."""
    return os.urandom(16)
