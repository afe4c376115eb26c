"""Wire formats of a private swarm: member certificates, revocations, public swarm info, member credentials.

Every format is msgpack with a version field; ``from_bytes`` checks every field and raises
:class:`MembershipError` on malformed input. Signatures cover a canonical msgpack list with a domain tag.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from privacy.errors import MembershipError
from privacy.files import read_private, write_private
from privacy.identity import PUBLIC_KEY_SIZE, SIGNATURE_SIZE, fingerprint

logger = logging.getLogger(__name__)

WIRE_VERSION = 1
SECRET_SIZE = 32
MAX_WIRE_SIZE = 1 << 20
_CERT_DOMAIN = "fusionswarm/certificate/v1"
_REVOCATION_DOMAIN = "fusionswarm/revocation/v1"
_SWARM_FILE_TAG = "fusionswarm-swarm-v1"


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack_map(data: bytes, what: str) -> dict:
    """Decode a msgpack map of at most 1 MiB with a matching version field."""
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) > MAX_WIRE_SIZE:
        raise MembershipError(f"malformed {what}: expected at most {MAX_WIRE_SIZE} bytes of msgpack")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:
        raise MembershipError(f"malformed {what}: not valid msgpack ({e})") from None
    if not isinstance(obj, dict):
        raise MembershipError(f"malformed {what}: expected a msgpack map, got {type(obj).__name__}")
    if obj.get("v") != WIRE_VERSION:
        raise MembershipError(f"{what} has version {shown(obj.get('v'))}, this build reads {WIRE_VERSION}; upgrade")
    return obj


def shown(value: Any) -> str:
    """A short repr of an untrusted value for an error message (a nested list's repr may be huge, or recurse
    past Python's limit)."""
    if isinstance(value, (str, bytes, int, float, type(None))):
        return repr(value[:64] if isinstance(value, (str, bytes)) else value)
    return f"a {type(value).__name__}"


def checked(obj: dict, name: str, kind: type | tuple[type, ...], what: str, size: int | None = None) -> Any:
    """``obj[name]`` checked to be of ``kind`` (and ``size`` bytes long for bytes); floats accept ints."""
    value = obj.get(name)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise MembershipError(f"malformed {what}: field {name!r} must be {getattr(kind, '__name__', kind)}")
    if kind is float and not math.isfinite(value):
        raise MembershipError(f"malformed {what}: field {name!r} must be a finite number")
    if size is not None and len(value) != size:
        raise MembershipError(f"malformed {what}: field {name!r} must be {size} bytes, got {len(value)}")
    return value


def key_from_swarm_id(swarm_id: str) -> bytes:
    """The owner's public key named by a swarm id (its 64-char hex)."""
    try:
        key = bytes.fromhex(swarm_id)
    except (ValueError, TypeError):
        key = b""
    if len(key) != PUBLIC_KEY_SIZE:
        raise MembershipError(f"swarm id {swarm_id!r} is not 64 hex characters (the owner's public key)")
    return key


@dataclass(frozen=True)
class Certificate:
    """The swarm owner's statement that ``member_key`` belongs to the swarm from ``issued_at`` to ``expires_at``."""

    swarm_id: str
    member_key: bytes
    name: str
    serial: str
    issued_at: float
    expires_at: float
    signature: bytes

    def signed_payload(self) -> bytes:
        return pack([_CERT_DOMAIN, self.swarm_id, bytes(self.member_key), self.name, self.serial,
                     float(self.issued_at), float(self.expires_at)])

    def to_bytes(self) -> bytes:
        return pack({"v": WIRE_VERSION, "swarm": self.swarm_id, "key": bytes(self.member_key), "name": self.name,
                     "serial": self.serial, "iat": float(self.issued_at), "exp": float(self.expires_at),
                     "sig": bytes(self.signature)})

    @classmethod
    def from_bytes(cls, data: bytes) -> Certificate:
        what = "certificate"
        obj = unpack_map(data, what)
        return cls(swarm_id=checked(obj, "swarm", str, what),
                   member_key=checked(obj, "key", bytes, what, PUBLIC_KEY_SIZE),
                   name=checked(obj, "name", str, what), serial=checked(obj, "serial", str, what),
                   issued_at=checked(obj, "iat", float, what), expires_at=checked(obj, "exp", float, what),
                   signature=checked(obj, "sig", bytes, what, SIGNATURE_SIZE))

    @property
    def member_fingerprint(self) -> str:
        return fingerprint(self.member_key)

    def __str__(self) -> str:
        return f"certificate of {self.name!r} (key {self.member_fingerprint}, serial {self.serial[:8]})"


@dataclass(frozen=True)
class Revocation:
    """The owner's signed list of revoked certificate serials; a later one includes all earlier serials."""

    swarm_id: str
    serials: tuple[str, ...]
    issued_at: float
    signature: bytes

    def signed_payload(self) -> bytes:
        return pack([_REVOCATION_DOMAIN, self.swarm_id, list(self.serials), float(self.issued_at)])

    def to_bytes(self) -> bytes:
        return pack({"v": WIRE_VERSION, "swarm": self.swarm_id, "serials": list(self.serials),
                     "iat": float(self.issued_at), "sig": bytes(self.signature)})

    @classmethod
    def from_bytes(cls, data: bytes) -> Revocation:
        what = "revocation"
        obj = unpack_map(data, what)
        serials = checked(obj, "serials", list, what)
        if not all(isinstance(s, str) for s in serials):
            raise MembershipError("malformed revocation: every serial must be a string")
        return cls(swarm_id=checked(obj, "swarm", str, what), serials=tuple(serials),
                   issued_at=checked(obj, "iat", float, what),
                   signature=checked(obj, "sig", bytes, what, SIGNATURE_SIZE))


@dataclass(frozen=True)
class SwarmInfo:
    """What anyone needs to check certificates of a swarm: its id and its owner's public key. Not secret."""

    swarm_id: str
    owner_key: bytes

    def __post_init__(self):
        if key_from_swarm_id(self.swarm_id) != self.owner_key:
            raise MembershipError(f"swarm id {self.swarm_id[:16]}... does not match the owner key given with it")

    @classmethod
    def from_swarm_id(cls, swarm_id: str) -> SwarmInfo:
        return cls(swarm_id=swarm_id, owner_key=key_from_swarm_id(swarm_id))

    def save(self, path: str | Path) -> Path:
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{_SWARM_FILE_TAG} {self.swarm_id}\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> SwarmInfo:
        path = Path(path).expanduser()
        parts = path.read_text(errors="replace").split()
        if len(parts) != 2 or parts[0] != _SWARM_FILE_TAG:
            raise MembershipError(f"{path} is not a swarm file (expected '{_SWARM_FILE_TAG} <swarm id>')")
        return cls.from_swarm_id(parts[1])


@dataclass(frozen=True)
class MemberCredentials:
    """What a member receives, privately, from the owner: its certificate and the swarm's record secret."""

    certificate: Certificate
    swarm_secret: bytes = dataclasses.field(repr=False)
    owner_key: bytes

    def __post_init__(self):
        if len(self.swarm_secret) != SECRET_SIZE:
            raise MembershipError(f"a swarm secret must be {SECRET_SIZE} bytes, got {len(self.swarm_secret)}")
        if key_from_swarm_id(self.certificate.swarm_id) != self.owner_key:
            raise MembershipError("member credentials are inconsistent: the certificate names another swarm owner")

    @property
    def swarm(self) -> SwarmInfo:
        return SwarmInfo(self.certificate.swarm_id, self.owner_key)

    def to_bytes(self) -> bytes:
        return pack({"v": WIRE_VERSION, "kind": "member", "cert": self.certificate.to_bytes(),
                     "secret": bytes(self.swarm_secret), "owner": bytes(self.owner_key)})

    @classmethod
    def from_bytes(cls, data: bytes) -> MemberCredentials:
        what = "member credentials"
        obj = unpack_map(data, what)
        if obj.get("kind") != "member":
            raise MembershipError(f"malformed {what}: this is a {shown(obj.get('kind'))} file, not member credentials")
        return cls(certificate=Certificate.from_bytes(checked(obj, "cert", bytes, what)),
                   swarm_secret=checked(obj, "secret", bytes, what, SECRET_SIZE),
                   owner_key=checked(obj, "owner", bytes, what, PUBLIC_KEY_SIZE))

    def save(self, path: str | Path, *, overwrite: bool = False) -> Path:
        return write_private(path, self.to_bytes(), what="member credentials", overwrite=overwrite)

    @classmethod
    def load(cls, path: str | Path) -> MemberCredentials:
        data = read_private(path, what="member credentials")
        try:
            return cls.from_bytes(data)
        except MembershipError as e:
            raise MembershipError(f"member credentials file {path} is unreadable: {e}; ask the owner to re-invite") \
                from None
