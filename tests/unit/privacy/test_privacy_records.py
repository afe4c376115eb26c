"""PrivateRecordValidator: unit checks, then real in-process hivemind DHT nodes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import dataclasses

import msgpack
import pytest
from hivemind.dht import DHTID, DHTNode
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from privacy.identity import Identity
from privacy.membership import MembershipVerifier, SwarmOwner
from privacy.records import PrivateRecordValidator, member_subkey

HOST = ["/ip4/127.0.0.1/tcp/0"]
SECRET = "plaintext-that-only-members-may-read"


def member_validator(owner: SwarmOwner, name: str, **invite) -> PrivateRecordValidator:
    identity = Identity.generate()
    creds = owner.invite(identity.public_bytes, name, invite.pop("ttl", 3600), **invite)
    return PrivateRecordValidator(MembershipVerifier(owner.public_info()), creds, identity)


def record_for(validator: PrivateRecordValidator, value: object = SECRET, subkey: object = None) -> DHTRecord:
    subkey = member_subkey(validator.identity.public_bytes) if subkey is None else subkey
    return DHTRecord(b"\x01" * 20, MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value),
                     get_dht_time() + 60)


def signed(validator: PrivateRecordValidator, record: DHTRecord) -> DHTRecord:
    return dataclasses.replace(record, value=validator.sign_value(record))


def test_sign_validate_strip_and_refusals():
    owner = SwarmOwner.generate()
    alice, bob = member_validator(owner, "alice"), member_validator(owner, "bob")
    record = record_for(alice)
    sealed = signed(alice, record)
    assert SECRET.encode() not in sealed.value
    cert = alice.credentials.certificate  # who the member is stays sealed too
    assert b"alice" not in sealed.value and cert.serial.encode() not in sealed.value
    assert cert.to_bytes() not in sealed.value and cert.signature not in sealed.value
    assert bob.validate(sealed) and bob.strip_value(sealed) == record.value
    composite = CompositeValidator([bob])
    assert composite.validate(sealed) and composite.strip_value(sealed) == record.value

    ciphertext_flipped = bytearray(sealed.value)
    ciphertext_flipped[-70] ^= 1  # inside the ciphertext, just before the signature
    assert not bob.validate(dataclasses.replace(sealed, value=bytes(ciphertext_flipped)))
    assert not bob.validate(dataclasses.replace(sealed, key=b"\x02" * 20))  # moved to another key
    assert not bob.validate(dataclasses.replace(sealed, expiration_time=sealed.expiration_time + 1))
    assert not bob.validate(signed(alice, record_for(alice, subkey=member_subkey(bob.identity.public_bytes))))
    plain_value = dataclasses.replace(record, subkey=MSGPackSerializer.dumps(None))  # hivemind's "no subkey"
    assert not bob.validate(signed(alice, plain_value))
    assert not bob.validate(record) and not bob.validate(dataclasses.replace(record, value=b""))


def test_relay_without_credentials_checks_but_cannot_read_or_store():
    owner = SwarmOwner.generate()
    alice = member_validator(owner, "alice")
    relay = PrivateRecordValidator(MembershipVerifier(owner.public_info()), None, None)
    sealed = signed(alice, record_for(alice))
    assert relay.validate(sealed)  # the peer id under which it is stored signed it
    bob_subkey = MSGPackSerializer.dumps(member_subkey(Identity.generate().public_bytes))
    assert not relay.validate(dataclasses.replace(sealed, subkey=bob_subkey))  # moved under another peer id
    assert relay.strip_value(sealed) == sealed.value  # still sealed
    assert relay.sign_value(record_for(alice)) == b""  # never leaks the plaintext


def run_nodes(body, timeout: float = 60):
    nodes: list[DHTNode] = []

    async def start(validator, initial_peers=()) -> DHTNode:
        node = await DHTNode.create(record_validator=validator, host_maddrs=HOST, initial_peers=list(initial_peers),
                                    cache_locally=False)
        nodes.append(node)
        return node

    async def main():
        try:
            await asyncio.wait_for(body(start), timeout)
        finally:
            await asyncio.gather(*(node.shutdown() for node in nodes), return_exceptions=True)

    asyncio.run(main())


async def maddrs(node: DHTNode) -> list[str]:
    return [str(m) for m in await node.get_visible_maddrs()]


def entries(found) -> dict:
    return {} if found is None else {subkey: item.value for subkey, item in found.value.items()}


def test_members_share_records_and_outsiders_see_only_ciphertext():
    owner, foreign = SwarmOwner.generate(), SwarmOwner.generate()
    alice, bob = member_validator(owner, "alice"), member_validator(owner, "bob")
    stranger = member_validator(foreign, "stranger")  # a member of another swarm

    async def body(start):
        a = await start(alice)
        peers = await maddrs(a)
        b = await start(bob, peers)
        expiration = get_dht_time() + 60
        a_sub, b_sub = member_subkey(alice.identity.public_bytes), member_subkey(bob.identity.public_bytes)
        # hivemind's store() reports whichever replica answers first: assert it only while all nodes are members
        assert await a.store("swarm.peers", {"who": "alice", "note": SECRET}, expiration, subkey=a_sub)
        assert await b.store("swarm.peers", {"who": "bob"}, expiration, subkey=b_sub)
        assert not await a.store("swarm.peers", {"who": "fake bob"}, expiration, subkey=b_sub)
        assert not await a.store("swarm.plain", "no subkey", expiration)

        plain, other = await start(None, peers), await start(stranger, peers)
        await plain.store("swarm.peers", {"who": "intruder"}, expiration, subkey="intruder")  # junk on its node
        for reader in (a, b):
            assert reader.protocol.storage.get(DHTID.generate(source="swarm.peers")) is not None
            got = entries(await reader.get("swarm.peers", latest=True))
            assert got == {a_sub: {"who": "alice", "note": SECRET}, b_sub: {"who": "bob"}}

        raw = entries(await plain.get("swarm.peers", latest=True))
        assert a_sub in raw and SECRET.encode() not in msgpack.packb(raw[a_sub], use_bin_type=True)
        assert await other.get("swarm.peers", latest=True) is None  # other swarm: refuses every record

    run_nodes(body)


@pytest.mark.parametrize("kind", ["no validator", "other swarm", "expired", "revoked"])
def test_non_members_cannot_store_records_members_accept(kind):
    owner = SwarmOwner.generate()
    alice, bob = member_validator(owner, "alice"), member_validator(owner, "bob")
    outsider_identity = Identity.generate()
    if kind == "no validator":
        outsider = None
    elif kind == "other swarm":
        outsider = member_validator(SwarmOwner.generate(), "mallory")
    elif kind == "expired":
        outsider = member_validator(owner, "mallory", ttl=60, not_before=get_dht_time() - 3600)
    else:
        outsider = member_validator(owner, "mallory")
        revocation = owner.revoke([outsider.credentials.certificate.serial])
        alice.verifier.update_revocations(revocation)
        bob.verifier.update_revocations(revocation)
    if outsider is not None:
        outsider_identity = outsider.identity

    async def body(start):
        a = await start(alice)
        peers = await maddrs(a)
        b, x = await start(bob, peers), await start(outsider, peers)
        subkey = member_subkey(outsider_identity.public_bytes)
        await x.store("swarm.peers", {"who": "mallory"}, get_dht_time() + 60, subkey=subkey)
        for reader in (a, b):
            assert await reader.get("swarm.peers", latest=True) is None
            assert reader.protocol.storage.get(DHTID.generate(source="swarm.peers")) is None  # never stored

    run_nodes(body)


def test_record_may_not_outlive_its_certificate():
    owner = SwarmOwner.generate()
    alice, bob = member_validator(owner, "alice", ttl=30), member_validator(owner, "bob")
    assert bob.validate(signed(alice, dataclasses.replace(record_for(alice), expiration_time=get_dht_time() + 20)))
    assert not bob.validate(signed(alice, record_for(alice)))  # expires in 60 s, the certificate in 30 s


def test_revoked_member_records_are_purged_from_storage():
    owner = SwarmOwner.generate()
    alice, bob, mallory = (member_validator(owner, name) for name in ("alice", "bob", "mallory"))
    subs = {name: member_subkey(v.identity.public_bytes) for name, v in zip("abm", (alice, bob, mallory), strict=True)}

    async def body(start):
        a = await start(alice)
        peers = await maddrs(a)
        b, m = await start(bob, peers), await start(mallory, peers)
        expiration = get_dht_time() + 60
        for node, name in ((a, "a"), (b, "b"), (m, "m")):
            assert await node.store("swarm.peers", name, expiration, subkey=subs[name])
        assert set(entries(await b.get("swarm.peers", latest=True))) == set(subs.values())

        revocation = owner.revoke([mallory.credentials.certificate.serial])
        for validator in (alice, bob):
            validator.verifier.update_revocations(revocation)
        # hivemind never revalidates its own storage: bob still serves mallory's entry from it
        assert subs["m"] in entries(await b.get("swarm.peers", latest=True))
        for node, validator in ((a, alice), (b, bob)):
            assert validator.purge_storage(node.protocol.storage) == 1
            validator.purge_storage(node.protocol.cache)
        # mallory's node still answers, but its dictionary holds a revoked entry and is dropped as a whole
        assert entries(await b.get("swarm.peers", latest=True)) == {subs["a"]: "a", subs["b"]: "b"}
        assert entries(await a.get("swarm.peers", latest=True)) == {subs["a"]: "a", subs["b"]: "b"}

    run_nodes(body)
