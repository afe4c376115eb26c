"""Certificates and revocations: issue, verify, every refusal, files, malformed input."""

from __future__ import annotations

import dataclasses
import os
import stat

import msgpack
import pytest

from privacy.errors import MembershipError, PrivacyError
from privacy.identity import Identity
from privacy.membership import (
    Certificate,
    MemberCredentials,
    MembershipVerifier,
    Revocation,
    SwarmInfo,
    SwarmOwner,
)

DAY = 86400.0


def test_issue_and_verify(owner, member, verifier):
    creds = owner.invite(member.public_bytes, "alice", DAY)
    cert = creds.certificate
    assert cert.swarm_id == owner.swarm_id == owner.identity.public_bytes.hex()
    assert cert.member_key == member.public_bytes and cert.name == "alice"
    assert creds.swarm_secret == owner.swarm_secret and creds.owner_key == owner.identity.public_bytes
    verifier.verify(cert)
    verifier.verify(cert, presenter_key=member.public_bytes)
    assert Certificate.from_bytes(cert.to_bytes()) == cert


def test_wrong_swarm(owner, member, verifier):
    cert = SwarmOwner.generate().invite(member.public_bytes, "alice", DAY).certificate
    with pytest.raises(MembershipError, match=r"certificate is for swarm \w+\.\.\., not \w+"):
        verifier.verify(cert)


@pytest.mark.parametrize("change", [
    {"name": "mallory"},
    {"member_key": Identity.generate().public_bytes},
    {"serial": "00" * 16},
    {"expires_at": 1e12},
    {"issued_at": 0.0},
    {"signature": bytes(64)},
])
def test_tampered_fields_break_owner_signature(owner, member, verifier, change):
    cert = owner.invite(member.public_bytes, "alice", DAY).certificate
    with pytest.raises(MembershipError, match="invalid owner signature"):
        verifier.verify(dataclasses.replace(cert, **change))


def test_expired(owner, member, verifier, clock):
    cert = owner.invite(member.public_bytes, "alice", 60).certificate
    clock.now += 30
    verifier.verify(cert)
    clock.now += 31
    with pytest.raises(MembershipError, match="certificate of 'alice' expired at .* new invite"):
        verifier.verify(cert)


def test_not_yet_valid(owner, member, verifier, clock):
    cert = owner.invite(member.public_bytes, "alice", DAY, not_before=clock.now + 3600).certificate
    with pytest.raises(MembershipError, match="not valid until"):
        verifier.verify(cert)
    clock.now += 3600
    verifier.verify(cert)


def test_revoked_and_revocations_accumulate(owner, member, verifier):
    alice = owner.invite(member.public_bytes, "alice", DAY).certificate
    bob = owner.invite(Identity.generate().public_bytes, "bob", DAY).certificate
    first = owner.revoke([alice.serial])
    verifier.update_revocations(first)
    assert verifier.is_revoked(alice.serial) and not verifier.is_revoked(bob.serial)
    with pytest.raises(MembershipError, match="revoked"):
        verifier.verify(alice)
    verifier.verify(bob)
    second = owner.revoke([bob.serial], previous=first)
    assert set(second.serials) == {alice.serial, bob.serial} and second.issued_at > first.issued_at
    fresh = MembershipVerifier(owner.public_info())
    fresh.update_revocations(Revocation.from_bytes(second.to_bytes()))
    fresh.update_revocations(first)  # older: ignored
    assert fresh.revocation == second
    assert fresh.is_revoked(alice.serial) and fresh.is_revoked(bob.serial)


def test_revocation_with_bad_signature_or_foreign_swarm_is_refused(owner, verifier):
    rev = owner.revoke(["ab" * 16])
    with pytest.raises(MembershipError, match="invalid owner signature"):
        verifier.update_revocations(dataclasses.replace(rev, serials=()))
    with pytest.raises(MembershipError, match="revocation is for swarm"):
        verifier.update_revocations(SwarmOwner.generate().revoke(["ab" * 16]))
    assert not verifier.is_revoked("ab" * 16)


def test_presenter_mismatch(owner, member, verifier):
    cert = owner.invite(member.public_bytes, "alice", DAY).certificate
    with pytest.raises(MembershipError, match="presented by"):
        verifier.verify(cert, presenter_key=Identity.generate().public_bytes)


@pytest.mark.parametrize("data", [
    b"", b"\xff\xff", msgpack.packb([1, 2]), msgpack.packb({"v": 99}),
    msgpack.packb({"v": 1, "swarm": "x", "key": b"short", "name": "a", "serial": "s", "iat": 1.0, "exp": 2.0,
                   "sig": bytes(64)}),
    msgpack.packb({"v": 1, "swarm": "x", "key": bytes(32), "name": 5, "serial": "s", "iat": 1.0, "exp": 2.0,
                   "sig": bytes(64)}),
    msgpack.packb({"v": 1, "swarm": "x", "key": bytes(32), "name": "a", "serial": "s", "iat": 1.0,
                   "exp": float("nan"), "sig": bytes(64)}),
])
def test_malformed_certificate_bytes(data):
    with pytest.raises(MembershipError, match="malformed|version"):
        Certificate.from_bytes(data)


def test_owner_credentials_and_swarm_files(tmp_path, owner, member):
    owner_path = owner.save(tmp_path / "owner" / "swarm.owner")
    assert stat.S_IMODE(owner_path.stat().st_mode) == 0o600
    loaded = SwarmOwner.load(owner_path)
    assert loaded.swarm_id == owner.swarm_id and loaded.swarm_secret == owner.swarm_secret

    creds = owner.invite(member.public_bytes, "alice", DAY)
    creds_path = creds.save(tmp_path / "alice.creds")
    assert stat.S_IMODE(creds_path.stat().st_mode) == 0o600
    assert MemberCredentials.load(creds_path) == creds
    os.chmod(creds_path, 0o640)
    with pytest.raises(PrivacyError, match="chmod 600"):
        MemberCredentials.load(creds_path)

    info_path = owner.public_info().save(tmp_path / "swarm.pub")
    assert SwarmInfo.load(info_path) == owner.public_info() == SwarmInfo.from_swarm_id(owner.swarm_id)
    info_path.write_text("garbage")
    with pytest.raises(MembershipError, match="not a swarm file"):
        SwarmInfo.load(info_path)
