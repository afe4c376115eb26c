"""DHT records of a private swarm: signed by a member, encrypted with the swarm secret, checked on every hop.

Hivemind calls ``sign_value`` before a store leaves the node, ``validate`` on every record it is asked to store
or receives in a find (and before storing its own), and ``strip_value`` only on validated records before
``get`` returns them. Values are bytes in and out: ``record.value`` is the msgpack the application stored.
``record.key`` is the DHTID bytes of the key and ``record.subkey`` the msgpack of the subkey.

Every record must be a dictionary entry stored under ``subkey=member_subkey(own public key)``, which is the
member's libp2p peer id: a member can neither impersonate nor overwrite another member's entry, nor announce a
record under a peer id that is not its own; plain (subkey-less) values are refused.

The member's certificate travels inside the ciphertext with the value, so outsiders learn neither the value nor
who the member is (its name, serial, expiry); they see the peer id (public anyway on every libp2p connection),
a nonce, the ciphertext and the member's signature over them.
"""

from __future__ import annotations

import logging
import os

import msgpack
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer

from privacy.certificates import WIRE_VERSION, Certificate, MemberCredentials, checked, pack, unpack_map
from privacy.errors import MembershipError, PrivacyError
from privacy.identity import SIGNATURE_SIZE, Identity, verify_signature
from privacy.membership import MembershipVerifier
from privacy.peer_ids import peer_id_of, public_key_of

logger = logging.getLogger(__name__)

_KEY_DOMAIN = b"fusionswarm/records/key/v1"
_AAD_DOMAIN = "fusionswarm/records/location/v1"
_SIGN_DOMAIN = "fusionswarm/records/signature/v1"
NONCE_SIZE = 12


def member_subkey(member_key: bytes) -> str:
    """The DHT subkey under which the member with Ed25519 public key ``member_key`` must store its records:
    its peer id, the same subkey a public swarm uses."""
    return peer_id_of(bytes(member_key))


def record_key(swarm_secret: bytes, swarm_id: str) -> bytes:
    """The AES-256-GCM key that encrypts a swarm's DHT records, derived from its secret."""
    return HKDF(hashes.SHA256(), 32, salt=_KEY_DOMAIN, info=swarm_id.encode()).derive(swarm_secret)


def _location(record: DHTRecord) -> bytes:
    return pack([_AAD_DOMAIN, record.key, record.subkey, float(record.expiration_time)])


def _signed(record: DHTRecord, nonce: bytes, ciphertext: bytes) -> bytes:
    return pack([_SIGN_DOMAIN, record.key, record.subkey, float(record.expiration_time), nonce, ciphertext])


class PrivateRecordValidator(RecordValidatorBase):
    """Signs, encrypts and checks records so that non-members can neither read nor forge them.

    Without ``credentials`` and ``identity`` the validator is a relay: it checks that the peer id under which a
    record is stored signed it, but cannot check membership (the certificate is sealed), store (``sign_value``
    returns an empty value) nor read records (``strip_value`` returns the sealed value).
    """

    def __init__(self, verifier: MembershipVerifier, credentials: MemberCredentials | None,
                 identity: Identity | None):
        self.verifier, self.credentials, self.identity = verifier, credentials, identity
        self._aead: AESGCM | None = None
        self._cert_bytes = b""
        if credentials is not None:
            cert = credentials.certificate
            if cert.swarm_id != verifier.swarm.swarm_id:
                raise MembershipError(f"member credentials are for swarm {cert.swarm_id[:16]}..., but the verifier "
                                      f"checks swarm {verifier.swarm.swarm_id[:16]}...; load the matching swarm file")
            if identity is not None and identity.public_bytes != cert.member_key:
                raise MembershipError(f"{cert} was issued for key {cert.member_fingerprint}, but this node's identity "
                                      f"is {identity.fingerprint}; start with the identity the invite was made for")
            self._aead = AESGCM(record_key(credentials.swarm_secret, cert.swarm_id))
            self._cert_bytes = cert.to_bytes()
            try:
                verifier.verify(cert)
            except MembershipError as e:
                logger.warning("own certificate is not valid now, peers will refuse our records: %s", e)
        self._own_subkey = None if identity is None else MSGPackSerializer.dumps(member_subkey(identity.public_bytes))
        self._warned_relay = False

    @property
    def priority(self) -> int:
        # Between SchemaValidator (0), which must see the decrypted value, and RSASignatureValidator (10),
        # whose signature suffix must be stripped before our envelope is parsed.
        return 5

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False  # each validator in hivemind's CompositeValidator is applied in turn; nothing to merge

    def sign_value(self, record: DHTRecord) -> bytes:
        if self.identity is None or self._aead is None:
            logger.error("cannot store a record in a private swarm without member credentials and identity; "
                         "the record is dropped (join with `swarm invite` credentials)")
            return b""
        if record.subkey != self._own_subkey:
            logger.warning("record stored under a subkey other than member_subkey(own key) will be refused by peers")
        if record.expiration_time > self.credentials.certificate.expires_at:
            logger.warning("record expires after our certificate (%s) and will be refused by peers; renew the invite",
                           self.credentials.certificate)
        nonce = os.urandom(NONCE_SIZE)
        sealed = pack({"v": WIRE_VERSION, "cert": self._cert_bytes, "value": record.value})
        ciphertext = self._aead.encrypt(nonce, sealed, _location(record))
        signature = self.identity.sign(_signed(record, nonce, ciphertext))
        return pack({"v": WIRE_VERSION, "nonce": nonce, "ct": ciphertext, "sig": signature})

    @staticmethod
    def _envelope(record: DHTRecord) -> tuple[bytes, bytes, bytes]:
        what = "private swarm record"
        obj = unpack_map(record.value, what)
        return (checked(obj, "nonce", bytes, what, NONCE_SIZE), checked(obj, "ct", bytes, what),
                checked(obj, "sig", bytes, what, SIGNATURE_SIZE))

    def _contents(self, record: DHTRecord, nonce: bytes, ciphertext: bytes) -> tuple[Certificate, bytes]:
        """The certificate and the value inside a record (``InvalidTag`` if it is not sealed for this swarm)."""
        what = "private swarm record contents"
        obj = unpack_map(self._aead.decrypt(nonce, ciphertext, _location(record)), what)
        return Certificate.from_bytes(checked(obj, "cert", bytes, what)), checked(obj, "value", bytes, what)

    def validate(self, record: DHTRecord) -> bool:
        try:
            nonce, ciphertext, signature = self._envelope(record)
            # plain msgpack, not hivemind's serializer: its ext hook recurses through C for nested tuples, and a
            # 1 KiB subkey of nested tuples overflows the C stack (a segfault); a valid subkey is a plain str
            subkey = msgpack.unpackb(record.subkey, raw=False)
            signer = public_key_of(subkey) if isinstance(subkey, str) else None
        except (PrivacyError, ValueError, TypeError) as e:
            logger.debug("refusing record under subkey %r: %s", record.subkey[:80], e)
            return False
        if signer is None:
            logger.debug("refusing record under subkey %r: records are stored under the member's peer id",
                         record.subkey[:80])
            return False
        if not verify_signature(signer, _signed(record, nonce, ciphertext), signature):
            logger.debug("refusing record under %s: bad signature (altered, or moved to another key)", subkey)
            return False
        if self._aead is None:
            return True  # a relay: the peer id signed it; whether it is a member is sealed inside
        try:
            cert, _ = self._contents(record, nonce, ciphertext)
            self.verifier.verify(cert)
        except InvalidTag:
            logger.debug("refusing record under %s: it does not decrypt with this swarm's secret", subkey)
            return False
        except MembershipError as e:
            logger.debug("refusing record under %s: %s", subkey, e)
            return False
        if cert.member_key != signer:
            logger.debug("refusing record of %s: stored under another member's peer id %s", cert, subkey)
            return False
        if record.expiration_time > cert.expires_at:  # else it would outlive the certificate in peers' storage
            logger.debug("refusing record of %s: it expires after the certificate", cert)
            return False
        return True

    def purge_storage(self, storage: DHTLocalStorage) -> int:
        """Remove entries this validator now refuses (e.g. of a member revoked since) from a node's storage.

        Hivemind never revalidates what it stored: call this on ``node.protocol.storage`` and ``.cache`` after
        :meth:`MembershipVerifier.update_revocations`. Otherwise the node serves the revoked member's records, and
        readers drop the node's whole dictionary because one entry in it fails validation. Returns entries removed.
        """
        removed = 0
        for key_id, (value, expiration_time) in list(storage.items()):
            if isinstance(value, DictionaryDHTValue):
                for subkey, (item, item_expiration) in list(value.items()):
                    if not self.validate(DHTRecord(key_id.to_bytes(), MSGPackSerializer.dumps(subkey), item,
                                                   item_expiration)):
                        del value[subkey]
                        removed += 1
                if not value:
                    del storage[key_id]
            elif not self.validate(DHTRecord(key_id.to_bytes(), MSGPackSerializer.dumps(None), value, expiration_time)):
                del storage[key_id]
                removed += 1
        if removed:
            logger.info("purged %d record(s) that are no longer valid from local DHT storage", removed)
        return removed

    def strip_value(self, record: DHTRecord) -> bytes:
        if self._aead is None:
            if not self._warned_relay:
                logger.warning("this node has no member credentials: it relays private records but cannot read them")
                self._warned_relay = True
            return record.value
        try:
            nonce, ciphertext, _ = self._envelope(record)
            return self._contents(record, nonce, ciphertext)[1]
        except (MembershipError, InvalidTag) as e:  # hivemind only strips validated records: should not happen
            logger.warning("cannot decrypt a record that passed validation (%s); returning it sealed", e)
            return record.value
