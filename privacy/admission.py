"""Who may call a peer: the one object both ends of every RPC consult, public swarm or private.

A handler never asks "is this swarm private?". It asks its :class:`Admission` to ``admit`` what the caller sent,
and a caller asks its own to make a ``proof``. In a public swarm (:class:`OpenAdmission`) proofs are empty and
everyone is admitted; in a private swarm (:class:`MemberAdmission`) a proof is a signed membership proof
(``privacy.membership.make_proof``) bound to the RPC, to the receiving peer and, on a stream, to the caller's
handshake; a request without a valid one is refused before any compute.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from privacy.errors import MembershipError, PrivacyError
from privacy.identity import Identity
from privacy.membership import Certificate, MemberCredentials, MembershipVerifier, Revocation, SwarmInfo, make_proof
from privacy.peer_ids import public_key_of
from privacy.records import PrivateRecordValidator

logger = logging.getLogger(__name__)

_CONTEXT_DOMAIN = b"fusionswarm/rpc/v1"


def proof_context(rpc: str, receiver_key: bytes, binding: bytes = b"") -> bytes:
    """What a proof is bound to: the RPC's name, the receiver's public key, the stream's handshake (if any)."""
    return b"|".join((_CONTEXT_DOMAIN, rpc.encode(), bytes(receiver_key), bytes(binding)))


def caller_key(remote_id: object) -> bytes | None:
    """The Ed25519 public key inside a caller's peer id (``context.remote_id``), or None if it embeds none."""
    try:
        return public_key_of(str(remote_id))
    except PrivacyError:
        return None


class Admission:
    """Public swarm: every caller is admitted and proofs are empty. Subclasses restrict who gets in."""

    required = False  # whether a request without a proof is refused
    swarm_id = ""  # "" for a public swarm

    def proof(self, context: bytes) -> bytes:
        return b""

    def admit(self, proof: bytes, context: bytes, caller_key: bytes | None) -> Certificate | None:
        """The caller's certificate (None in a public swarm); raises ``MembershipError`` to refuse it."""
        return None

    def recheck(self, admitted: Certificate | None) -> None:
        """Raise ``MembershipError`` if what ``admit`` returned has since expired or been revoked."""

    def record_validator(self):
        """A hivemind record validator for this swarm's DHT records, or None (public records)."""
        return None

    def describe(self) -> str:
        return "public swarm (anyone who knows a bootstrap address may join)"


OpenAdmission = Admission


@dataclass
class MemberAdmission(Admission):
    """Private swarm: only holders of a valid, unrevoked certificate of ``credentials``' swarm get in."""

    credentials: MemberCredentials
    identity: Identity
    verifier: MembershipVerifier

    required = True

    def __post_init__(self) -> None:
        cert = self.credentials.certificate
        if cert.member_key != self.identity.public_bytes:
            raise MembershipError(
                f"{cert} was issued for key {cert.member_fingerprint}, but this node's identity is "
                f"{self.identity.fingerprint}; pass the --identity_path the invite was made for "
                f"(`swarm invite --member_key` took its public key)")
        self.verifier.verify(cert)  # refuse to start with an expired or foreign certificate
        self._validator = PrivateRecordValidator(self.verifier, self.credentials, self.identity)

    @classmethod
    def load(cls, credentials_path: str | Path, identity: Identity,
             revocation_path: str | Path | None = None) -> MemberAdmission:
        """Credentials from ``swarm invite``; an optional revocation file from ``swarm revoke``."""
        credentials = MemberCredentials.load(credentials_path)
        verifier = MembershipVerifier(credentials.swarm)
        if revocation_path is not None:
            verifier.update_revocations(Revocation.from_bytes(Path(revocation_path).expanduser().read_bytes()))
        return cls(credentials, identity, verifier)

    @property
    def swarm_id(self) -> str:  # type: ignore[override]
        return self.credentials.certificate.swarm_id

    @property
    def swarm(self) -> SwarmInfo:
        return self.credentials.swarm

    def proof(self, context: bytes) -> bytes:
        return make_proof(self.identity, self.credentials.certificate, context)

    def admit(self, proof: bytes, context: bytes, caller_key: bytes | None) -> Certificate:
        if not proof:
            raise MembershipError(f"this peer serves only members of private swarm {self.swarm_id[:16]}...; "
                                  f"join with member credentials from its owner (`swarm invite`)")
        if caller_key is None:
            raise MembershipError("the caller's peer id embeds no Ed25519 key, so it cannot be a member; start it "
                                  "with the --identity_path its invite was made for")
        cert = self.verifier.check_proof(proof, context)
        if cert.member_key != bytes(caller_key):
            raise MembershipError(f"{cert} was presented by another peer: a member's proof is valid only from the "
                                  f"member's own peer id")
        return cert

    def recheck(self, admitted: Certificate | None) -> None:
        if admitted is None:
            raise MembershipError("this stream was never admitted")
        self.verifier.verify(admitted)  # signature cached: checks expiry and revocations

    def record_validator(self) -> PrivateRecordValidator:
        return self._validator

    def describe(self) -> str:
        cert = self.credentials.certificate
        return f"private swarm {self.swarm_id[:16]}... as member {cert.name!r}"
