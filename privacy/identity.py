"""A peer's long-term Ed25519 identity, kept in a file only its owner may read (mode 0600)."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from privacy.errors import PrivacyError
from privacy.files import read_private, write_private

logger = logging.getLogger(__name__)

PUBLIC_KEY_SIZE = 32
SIGNATURE_SIZE = 64


def fingerprint(public: bytes) -> str:
    """A short, human-comparable name of a public key: 16 hex chars of its SHA-256."""
    return hashlib.sha256(public).hexdigest()[:16]


class Identity:
    """An Ed25519 private key that signs on behalf of a peer, client or swarm owner."""

    def __init__(self, private_key: Ed25519PrivateKey):
        self._key = private_key
        self._public = private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_private_bytes(cls, data: bytes) -> Identity:
        """Build from the raw 32-byte private key (as returned by :meth:`private_bytes`)."""
        if not isinstance(data, (bytes, bytearray)) or len(data) != 32:
            raise PrivacyError("an Ed25519 private key must be exactly 32 raw bytes")
        return cls(Ed25519PrivateKey.from_private_bytes(bytes(data)))

    @classmethod
    def load_or_create(cls, path: str | Path) -> Identity:
        """Load the identity at ``path``, or create one there (mode 0600) if the file does not exist."""
        path = Path(path).expanduser()
        if not path.exists():
            identity = cls.generate()
            try:
                write_private(path, identity._to_pem(), what="identity")
                logger.info("created identity %s in %s", identity.fingerprint, path)
                return identity
            except FileExistsError:
                pass  # another process created it meanwhile: use theirs
        return cls.load(path)

    @classmethod
    def load(cls, path: str | Path) -> Identity:
        """Load an existing identity file (PEM PKCS#8 or raw 32 bytes); refuses unsafe modes and corrupt files."""
        path = Path(path).expanduser()
        data = read_private(path, what="identity")
        if len(data) == 32:
            return cls.from_private_bytes(data)
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as e:
            raise PrivacyError(
                f"identity file {path} is corrupt or not an unencrypted PEM private key ({e}); restore it from a "
                f"backup, or move it away to create a new identity (peers will then see a new key)"
            ) from None
        if not isinstance(key, Ed25519PrivateKey):
            raise PrivacyError(
                f"identity file {path} holds a {type(key).__name__}, not an Ed25519 key; move it away to create one"
            )
        return cls(key)

    def save(self, path: str | Path, *, overwrite: bool = False) -> Path:
        """Write this identity to ``path`` (PEM, mode 0600)."""
        return write_private(path, self._to_pem(), what="identity", overwrite=overwrite)

    def _to_pem(self) -> bytes:
        return self._key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    @property
    def public_bytes(self) -> bytes:
        """The raw 32-byte Ed25519 public key."""
        return self._public

    @property
    def fingerprint(self) -> str:
        return fingerprint(self._public)

    def private_bytes(self) -> bytes:
        """The raw 32-byte private key. Keep it secret."""
        return self._key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)

    def __repr__(self) -> str:
        return f"Identity({self.fingerprint})"


def verify_signature(public: bytes, data: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is ``public``'s Ed25519 signature of ``data``; False for any bad input, never raises."""
    try:
        if len(public) != PUBLIC_KEY_SIZE or len(signature) != SIGNATURE_SIZE:
            return False
        Ed25519PublicKey.from_public_bytes(bytes(public)).verify(bytes(signature), data)
        return True
    except InvalidSignature:
        return False
    except Exception:  # wrong types or sizes: not a valid signature either
        logger.debug("verify_signature got malformed input", exc_info=True)
        return False
