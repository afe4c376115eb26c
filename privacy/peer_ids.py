"""An ``Identity`` as a libp2p identity: the peer id *is* the Ed25519 public key, so it needs no signature.

libp2p names an Ed25519 peer by the identity multihash of its protobuf-encoded public key
(``12D3KooW...``). We write the identity's key in the libp2p format for the p2p daemon, and read the public
key back out of any such peer id, so a client can check a peer's handshake against the id it dialled.
"""

from __future__ import annotations

from pathlib import Path

from privacy.errors import PrivacyError
from privacy.files import read_private, write_private
from privacy.identity import Identity

_ED25519 = b"\x08\x01"  # protobuf field 1 (key type) = 1 (Ed25519)
_PUBLIC_PREFIX = b"\x00\x24" + _ED25519 + b"\x12\x20"  # identity multihash, 36 bytes: type, then 32-byte key
_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_MAX_PEER_ID = 64  # an Ed25519 peer id has 52 characters; decoding base58 costs time quadratic in its length


def libp2p_private_key(identity: Identity) -> bytes:
    """The identity as a libp2p ``PrivateKey`` protobuf (what ``p2pd -id FILE`` reads)."""
    return _ED25519 + b"\x12\x40" + identity.private_bytes() + identity.public_bytes


def peer_id_of(public: bytes) -> str:
    """The libp2p peer id (base58) of an Ed25519 public key."""
    if len(public) != 32:
        raise PrivacyError(f"an Ed25519 public key has 32 bytes, got {len(public)}")
    return _b58encode(_PUBLIC_PREFIX + public)


def public_key_of(peer_id: str) -> bytes:
    """The Ed25519 public key inside a libp2p peer id; ``PrivacyError`` if the id does not embed one."""
    if len(peer_id) > _MAX_PEER_ID:  # e.g. a DHT subkey of 100k characters took 11 s to decode
        raise PrivacyError(f"peer id {peer_id[:16]!r}... has {len(peer_id)} characters: it embeds no Ed25519 key")
    try:
        raw = _b58decode(peer_id)
    except ValueError as e:
        raise PrivacyError(f"peer id {peer_id!r} is not base58") from e
    if len(raw) != len(_PUBLIC_PREFIX) + 32 or not raw.startswith(_PUBLIC_PREFIX):
        raise PrivacyError(f"peer id {peer_id!r} does not embed an Ed25519 key (start the peer with --identity_path)")
    return raw[len(_PUBLIC_PREFIX):]


def _b58encode(data: bytes) -> str:
    number, out = int.from_bytes(data, "big"), ""
    while number:
        number, rest = divmod(number, 58)
        out = _ALPHABET[rest] + out
    return "1" * (len(data) - len(data.lstrip(b"\0"))) + out


def _b58decode(text: str) -> bytes:
    number = 0
    for char in text:
        index = _ALPHABET.find(char)
        if index < 0:
            raise ValueError(f"not a base58 character: {char!r}")
        number = number * 58 + index
    body = number.to_bytes((number.bit_length() + 7) // 8, "big")
    return b"\0" * (len(text) - len(text.lstrip("1"))) + body


def libp2p_key_file(identity_path: str | Path) -> Path:
    """Load or create the identity at ``identity_path`` (mode 0600) and write its libp2p key next to it.

    Returns the path of the libp2p key (``<identity_path>.p2p``, also 0600) to hand to the p2p daemon: the
    peer id is then the identity's public key and stays the same across restarts.
    """
    identity = Identity.load_or_create(identity_path)
    key_path = Path(f"{identity_path}.p2p")
    key = libp2p_private_key(identity)
    if not key_path.exists() or read_private(key_path, what="libp2p key") != key:
        write_private(key_path, key, what="libp2p key", overwrite=True)
    return key_path


def short_id(peer_id: object) -> str:
    """A peer id as logs and messages show it: ``...`` and its last 6 characters (enough to tell peers apart)."""
    return f"...{str(peer_id)[-6:]}"
