"""Identity files: mode 0600, reload gives the same key, unsafe or corrupt files are refused."""

from __future__ import annotations

import os
import stat

import pytest

from privacy.errors import PrivacyError
from privacy.identity import Identity, verify_signature


def test_created_file_is_0600_and_reloads_same_key(tmp_path):
    path = tmp_path / "keys" / "sub" / "identity.key"
    first = Identity.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = Identity.load_or_create(path)
    assert again.public_bytes == first.public_bytes and again.private_bytes() == first.private_bytes()
    assert len(first.public_bytes) == 32 and len(first.fingerprint) == 16
    assert [p.name for p in path.parent.iterdir()] == ["identity.key"]  # no temporary file left behind


def test_refuses_group_or_world_readable_file(tmp_path):
    path = tmp_path / "identity.key"
    Identity.load_or_create(path)
    os.chmod(path, 0o644)
    with pytest.raises(PrivacyError, match="chmod 600"):
        Identity.load_or_create(path)


def test_refuses_corrupt_file(tmp_path):
    path = tmp_path / "identity.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"-----BEGIN PRIVATE KEY-----\nnot a key\n-----END PRIVATE KEY-----\n")
    os.close(fd)
    with pytest.raises(PrivacyError, match="corrupt"):
        Identity.load_or_create(path)


def test_raw_private_bytes_round_trip_and_save_never_overwrites(tmp_path):
    identity = Identity.generate()
    assert Identity.from_private_bytes(identity.private_bytes()).public_bytes == identity.public_bytes
    path = identity.save(tmp_path / "id.pem")
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        Identity.generate().save(path)
    assert Identity.load(path).public_bytes == identity.public_bytes


def test_verify_signature_never_raises():
    identity = Identity.generate()
    sig = identity.sign(b"data")
    assert verify_signature(identity.public_bytes, b"data", sig)
    assert not verify_signature(identity.public_bytes, b"other", sig)
    assert not verify_signature(Identity.generate().public_bytes, b"data", sig)
    assert not verify_signature(b"short", b"data", sig)
    assert not verify_signature(identity.public_bytes, b"data", sig[:10])
    assert not verify_signature(None, b"data", sig)  # type: ignore[arg-type]
    assert not verify_signature(identity.public_bytes, None, sig)  # type: ignore[arg-type]
