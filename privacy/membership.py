"""Private swarm membership: the owner issues and revokes certificates, everyone verifies them and RPC proofs.

A swarm is named by its owner's Ed25519 public key (hex). The owner invites a member by signing a
:class:`Certificate` for the member's own key and handing it, with the swarm's record secret, as
:class:`MemberCredentials`. A member proves membership to a peer with :func:`make_proof`, bound to a context
(e.g. RPC name + receiver's peer id); the receiver checks it with :meth:`MembershipVerifier.check_proof`.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path

from privacy.certificates import (
    SECRET_SIZE,
    WIRE_VERSION,
    Certificate,
    MemberCredentials,
    Revocation,
    SwarmInfo,
    checked,
    pack,
    unpack_map,
)
from privacy.errors import MembershipError
from privacy.files import read_private, write_private
from privacy.identity import PUBLIC_KEY_SIZE, SIGNATURE_SIZE, Identity, fingerprint, verify_signature

__all__ = ["Certificate", "MemberCredentials", "MembershipVerifier", "Revocation", "SwarmInfo", "SwarmOwner",
           "make_proof"]

logger = logging.getLogger(__name__)

_PROOF_DOMAIN = "fusionswarm/membership-proof/v1"
NONCE_SIZE = 16


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


class SwarmOwner:
    """The owner of a private swarm: its signing identity and the 32-byte secret that encrypts DHT records."""

    def __init__(self, identity: Identity, swarm_secret: bytes):
        if len(swarm_secret) != SECRET_SIZE:
            raise MembershipError(f"a swarm secret must be {SECRET_SIZE} bytes, got {len(swarm_secret)}")
        self.identity = identity
        self.swarm_secret = bytes(swarm_secret)

    @classmethod
    def generate(cls) -> SwarmOwner:
        return cls(Identity.generate(), secrets.token_bytes(SECRET_SIZE))

    @property
    def swarm_id(self) -> str:
        return self.identity.public_bytes.hex()

    def public_info(self) -> SwarmInfo:
        return SwarmInfo(self.swarm_id, self.identity.public_bytes)

    def save(self, path: str | Path, *, overwrite: bool = False) -> Path:
        data = pack({"v": WIRE_VERSION, "kind": "owner", "key": self.identity.private_bytes(),
                     "secret": self.swarm_secret})
        return write_private(path, data, what="swarm owner", overwrite=overwrite)

    @classmethod
    def load(cls, path: str | Path) -> SwarmOwner:
        data = read_private(path, what="swarm owner")
        what = f"swarm owner file {path}"
        obj = unpack_map(data, what)
        if obj.get("kind") != "owner":
            raise MembershipError(f"{what} holds {obj.get('kind')!r} data, not a swarm owner key")
        return cls(Identity.from_private_bytes(checked(obj, "key", bytes, what, 32)),
                   checked(obj, "secret", bytes, what, SECRET_SIZE))

    def invite(self, member_public: bytes, name: str, ttl: float, *, not_before: float | None = None
               ) -> MemberCredentials:
        """Certify ``member_public`` as ``name`` for ``ttl`` seconds (from now, or from ``not_before``)."""
        if not isinstance(member_public, bytes) or len(member_public) != PUBLIC_KEY_SIZE:
            raise MembershipError("a member key must be the member's 32-byte Ed25519 public key")
        if not isinstance(name, str) or not name:
            raise MembershipError("a member needs a non-empty name")
        if not ttl > 0:
            raise MembershipError(f"a certificate's ttl must be positive, got {ttl}")
        issued_at = float(time.time() if not_before is None else not_before)
        unsigned = Certificate(self.swarm_id, member_public, name, secrets.token_hex(16), issued_at,
                               issued_at + float(ttl), b"")
        cert = dataclasses.replace(unsigned, signature=self.identity.sign(unsigned.signed_payload()))
        logger.info("invited %s until %s", cert, _when(cert.expires_at))
        return MemberCredentials(cert, self.swarm_secret, self.identity.public_bytes)

    def revoke(self, serials: Iterable[str], previous: Revocation | None = None) -> Revocation:
        """A signed revocation of ``serials`` plus everything ``previous`` revoked."""
        known: set[str] = set()
        issued_at = time.time()
        if previous is not None:
            MembershipVerifier(self.public_info()).update_revocations(previous)  # refuses a foreign one
            known.update(previous.serials)
            issued_at = max(issued_at, previous.issued_at + 1e-3)
        known.update(serials)
        unsigned = Revocation(self.swarm_id, tuple(sorted(known)), issued_at, b"")
        logger.info("revocation lists %d certificate(s)", len(known))
        return Revocation(unsigned.swarm_id, unsigned.serials, issued_at, self.identity.sign(unsigned.signed_payload()))


def make_proof(identity: Identity, cert: Certificate, context: bytes) -> bytes:
    """A one-time membership proof: ``cert`` plus ``identity``'s signature over ``context``, a time and a nonce."""
    if identity.public_bytes != cert.member_key:
        raise MembershipError(f"{cert} belongs to key {cert.member_fingerprint}, not to this identity "
                              f"{identity.fingerprint}; load the identity the certificate was issued for")
    timestamp, nonce = time.time(), secrets.token_bytes(NONCE_SIZE)
    signature = identity.sign(_proof_payload(cert, context, timestamp, nonce))
    return pack({"v": WIRE_VERSION, "cert": cert.to_bytes(), "ts": timestamp, "nonce": nonce, "sig": signature})


def _proof_payload(cert: Certificate, context: bytes, timestamp: float, nonce: bytes) -> bytes:
    return pack([_PROOF_DOMAIN, cert.swarm_id, cert.serial, bytes(context), float(timestamp), nonce])


class MembershipVerifier:
    """Checks certificates and proofs against one swarm's owner key and the newest revocation seen."""

    def __init__(self, swarm: SwarmInfo, *, clock: Callable[[], float] = time.time, clock_skew: float = 60.0,
                 replay_cache_size: int = 100_000, signature_cache_size: int = 4096):
        self.swarm, self.clock, self.clock_skew = swarm, clock, clock_skew
        self._revocation: Revocation | None = None
        self._revoked: frozenset[str] = frozenset()
        self._good_certs: OrderedDict[Certificate, None] = OrderedDict()  # owner signature already checked
        self._seen_nonces: OrderedDict[tuple[bytes, bytes], float] = OrderedDict()  # -> forget after this time
        self._replay_cache_size, self._signature_cache_size = replay_cache_size, signature_cache_size
        self._lock = threading.Lock()

    @property
    def revocation(self) -> Revocation | None:
        """The newest revocation applied (to pass on to others), or None."""
        return self._revocation

    def is_revoked(self, serial: str) -> bool:
        return serial in self._revoked

    def update_revocations(self, rev: Revocation) -> None:
        """Apply an owner-signed revocation; an older one than already applied is ignored."""
        if rev.swarm_id != self.swarm.swarm_id:
            raise MembershipError(f"revocation is for swarm {rev.swarm_id[:16]}..., not {self.swarm.swarm_id[:16]}...")
        if not verify_signature(self.swarm.owner_key, rev.signed_payload(), rev.signature):
            raise MembershipError("revocation has an invalid owner signature: it was altered or not made by the owner")
        with self._lock:
            if self._revocation is not None and rev.issued_at <= self._revocation.issued_at:
                logger.debug("ignoring a revocation from %s: already have a newer one", _when(rev.issued_at))
                return
            self._revocation = rev
            self._revoked = self._revoked | frozenset(rev.serials)  # revocations never shrink
        logger.info("applied revocation of %s: %d certificate(s) revoked", _when(rev.issued_at), len(self._revoked))

    def verify(self, cert: Certificate, presenter_key: bytes | None = None) -> None:
        """Raise :class:`MembershipError` unless ``cert`` is a valid, current certificate of this swarm
        (and, with ``presenter_key``, one issued to that key)."""
        if cert.swarm_id != self.swarm.swarm_id:
            raise MembershipError(f"certificate is for swarm {cert.swarm_id[:16]}..., not "
                                  f"{self.swarm.swarm_id[:16]}...; the peer belongs to another swarm")
        self._check_owner_signature(cert)
        now = self.clock()
        if cert.issued_at > now + self.clock_skew:
            raise MembershipError(f"{cert} is not valid until {_when(cert.issued_at)}; check the clocks")
        if now > cert.expires_at:
            raise MembershipError(f"certificate of {cert.name!r} expired at {_when(cert.expires_at)}; "
                                  f"ask the swarm owner for a new invite")
        if cert.serial in self._revoked:
            raise MembershipError(f"{cert} was revoked by the swarm owner")
        if presenter_key is not None and bytes(presenter_key) != cert.member_key:
            raise MembershipError(f"{cert} belongs to key {cert.member_fingerprint}, but was presented by "
                                  f"{fingerprint(bytes(presenter_key))}; the presenter is not that member")

    def _check_owner_signature(self, cert: Certificate) -> None:
        with self._lock:
            if cert in self._good_certs:
                self._good_certs.move_to_end(cert)
                return
        if not verify_signature(self.swarm.owner_key, cert.signed_payload(), cert.signature):
            raise MembershipError(f"{cert} has an invalid owner signature: it was altered or not issued by the "
                                  f"owner of swarm {self.swarm.swarm_id[:16]}...")
        with self._lock:
            self._good_certs[cert] = None
            if len(self._good_certs) > self._signature_cache_size:
                self._good_certs.popitem(last=False)

    def check_proof(self, proof: bytes, context: bytes, *, max_age: float = 60) -> Certificate:
        """Verify a :func:`make_proof` proof made for ``context``; return its certificate or raise MembershipError."""
        what = "membership proof"
        obj = unpack_map(proof, what)
        cert = Certificate.from_bytes(checked(obj, "cert", bytes, what))
        timestamp = checked(obj, "ts", float, what)
        nonce = checked(obj, "nonce", bytes, what, NONCE_SIZE)
        signature = checked(obj, "sig", bytes, what, SIGNATURE_SIZE)
        self.verify(cert)
        if not verify_signature(cert.member_key, _proof_payload(cert, context, timestamp, nonce), signature):
            raise MembershipError(f"membership proof with {cert} has an invalid signature: it was made by another "
                                  f"key or for another context (RPC or receiving peer)")
        now = self.clock()
        if now - timestamp > max_age:
            raise MembershipError(f"membership proof of {cert.name!r} is {now - timestamp:.0f} s old (at most "
                                  f"{max_age:.0f} s allowed); make a fresh proof per call and check the clocks")
        if timestamp - now > self.clock_skew:
            raise MembershipError(f"membership proof of {cert.name!r} is dated {timestamp - now:.0f} s in the future; "
                                  f"check the clocks")
        replay_key = (cert.member_key, nonce)
        with self._lock:
            while self._seen_nonces and next(iter(self._seen_nonces.values())) < now:
                self._seen_nonces.popitem(last=False)
            if replay_key in self._seen_nonces:
                raise MembershipError(f"membership proof of {cert.name!r} was already used (replay); "
                                      f"make a fresh proof for every call")
            self._seen_nonces[replay_key] = max(timestamp, now) + max_age + self.clock_skew
            if len(self._seen_nonces) > self._replay_cache_size:
                self._seen_nonces.popitem(last=False)
        return cert
