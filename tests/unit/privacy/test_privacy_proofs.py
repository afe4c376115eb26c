"""Membership proofs for RPCs: good, replayed, too old, wrong context, signed by another key."""

from __future__ import annotations

import msgpack
import pytest

from privacy.errors import MembershipError
from privacy.identity import Identity
from privacy.membership import make_proof

CONTEXT = b"rpc_forward|12D3KooWreceiver"


@pytest.fixture
def cert(owner, member):
    return owner.invite(member.public_bytes, "alice", 86400).certificate


def test_good_proof(verifier, member, cert):
    assert verifier.check_proof(make_proof(member, cert, CONTEXT), CONTEXT) == cert


def test_replayed_nonce(verifier, member, cert):
    proof = make_proof(member, cert, CONTEXT)
    verifier.check_proof(proof, CONTEXT)
    with pytest.raises(MembershipError, match="already used"):
        verifier.check_proof(proof, CONTEXT)
    verifier.check_proof(make_proof(member, cert, CONTEXT), CONTEXT)  # a fresh one is fine


def test_too_old_and_from_the_future(verifier, owner, member, clock):
    cert = owner.invite(member.public_bytes, "alice", 86400, not_before=clock.now - 5000).certificate
    proof = make_proof(member, cert, CONTEXT)
    clock.now += 61
    with pytest.raises(MembershipError, match="s old"):
        verifier.check_proof(proof, CONTEXT)
    assert verifier.check_proof(proof, CONTEXT, max_age=120) == cert
    clock.now -= 1000
    with pytest.raises(MembershipError, match="in the future"):
        verifier.check_proof(make_proof(member, cert, CONTEXT), CONTEXT)


def test_wrong_context(verifier, member, cert):
    with pytest.raises(MembershipError, match="another context"):
        verifier.check_proof(make_proof(member, cert, CONTEXT), b"rpc_forward|12D3KooWsomeoneelse")


def test_signed_by_another_key(verifier, member, cert):
    other = Identity.generate()
    with pytest.raises(MembershipError, match="not to this identity"):
        make_proof(other, cert, CONTEXT)
    forged = msgpack.unpackb(make_proof(member, cert, CONTEXT))
    forged["sig"] = other.sign(b"anything")
    with pytest.raises(MembershipError, match="invalid signature"):
        verifier.check_proof(msgpack.packb(forged), CONTEXT)


def test_proof_checks_the_certificate(verifier, owner, member, cert, clock):
    verifier.update_revocations(owner.revoke([cert.serial]))
    with pytest.raises(MembershipError, match="revoked"):
        verifier.check_proof(make_proof(member, cert, CONTEXT), CONTEXT)


def test_malformed_proof(verifier):
    with pytest.raises(MembershipError, match="malformed"):
        verifier.check_proof(b"\x93\x01\x02", CONTEXT)
