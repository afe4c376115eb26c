"""The identity is the libp2p identity: peer id <-> Ed25519 public key, and the daemon's key file."""

from __future__ import annotations

import os

import base58
import pytest

from privacy.errors import PrivacyError
from privacy.identity import Identity
from privacy.peer_ids import _b58decode, _b58encode, libp2p_key_file, peer_id_of, public_key_of


@pytest.mark.parametrize("data", [b"", b"\0", b"\0\0\x01", os.urandom(1), os.urandom(38), b"\0" + os.urandom(37)])
def test_base58_matches_the_reference_library(data):
    assert _b58encode(data) == base58.b58encode(data).decode()
    assert _b58decode(_b58encode(data)) == data


def test_peer_id_embeds_the_public_key():
    identity = Identity.generate()
    peer_id = peer_id_of(identity.public_bytes)
    assert peer_id.startswith("12D3KooW")
    assert public_key_of(peer_id) == identity.public_bytes
    assert peer_id_of(Identity.generate().public_bytes) != peer_id


@pytest.mark.parametrize("peer_id, message", [
    ("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", "does not embed an Ed25519 key"),  # an RSA-style id
    ("12D3KooW0OIl", "not base58"),
    ("", "does not embed"),
])
def test_ids_without_an_ed25519_key_are_refused(peer_id, message):
    with pytest.raises(PrivacyError, match=message):
        public_key_of(peer_id)


def test_key_file_is_private_and_stable(tmp_path):
    path = tmp_path / "keys" / "peer.key"
    key_file = libp2p_key_file(path)
    assert oct(os.stat(path).st_mode & 0o777) == oct(os.stat(key_file).st_mode & 0o777) == "0o600"
    first = key_file.read_bytes()
    assert libp2p_key_file(path).read_bytes() == first  # same identity, same daemon key
    assert len(first) == 4 + 64 and first[:2] == b"\x08\x01"
