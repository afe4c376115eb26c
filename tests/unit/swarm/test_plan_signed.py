"""Signed plans: a broker signs, a reader checks signature, subkey, model; then the DHT round trip, public and
private (a non-member's plan is never read)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest
from hivemind.utils import get_dht_time

from privacy.identity import Identity
from privacy.membership import MembershipVerifier, SwarmOwner
from privacy.peer_ids import peer_id_of
from privacy.records import PrivateRecordValidator
from swarm.discovery import announce_plan, fetch_plans, start_node, visible_maddrs
from swarm.keys import plans_key
from swarm.plan.signed import PlanRejected, sign_plan, verify_plan
from swarm.plan.types import Assignment, Group, Plan

MODEL = "llama-tiny"
HOST = ("/ip4/127.0.0.1/tcp/0",)


def pid(name: str) -> str:
    return "12D3KooW" + name * 44


def make_plan(broker: Identity, version: int = 1, model: str = MODEL, run_id: str = "") -> Plan:
    group = Group((Assignment(pid("A"), 0, 2), Assignment(pid("B"), 2, 4)), seconds_per_token=0.01)
    return Plan(model=model, num_blocks=4, version=version, groups=(group,), backups=(pid("C"),),
                broker=peer_id_of(broker.public_bytes), made_at=1.5e9, run_id=run_id)


def test_sign_and_verify_round_trip():
    broker = Identity.generate()
    plan = make_plan(broker, run_id="run-1")
    value = sign_plan(plan, broker)
    assert verify_plan(value, plan.broker, MODEL) == plan


def test_signing_with_another_identity_is_refused():
    with pytest.raises(ValueError, match="signed by"):
        sign_plan(make_plan(Identity.generate()), Identity.generate())


def rejections():
    broker, other = Identity.generate(), Identity.generate()
    plan = make_plan(broker)
    good = sign_plan(plan, broker)
    altered = dict(good, plan={**good["plan"], "version": 2})  # a replayed signature over another version
    forged = sign_plan(dataclasses.replace(plan, broker=peer_id_of(other.public_bytes)), other)
    forged["plan"]["broker"] = plan.broker  # other's signature, claiming to be broker's plan
    return [
        ("altered", altered, plan.broker, MODEL, "not signed by it"),
        ("forged", forged, plan.broker, MODEL, "not signed by it"),
        ("misplaced", good, peer_id_of(other.public_bytes), MODEL, "stored under subkey"),
        ("other model", good, plan.broker, "other-model", "for model"),
        ("no signature", {"plan": good["plan"]}, plan.broker, MODEL, "must be a dict with"),
        ("short signature", dict(good, sig=b"x" * 10), plan.broker, MODEL, "64 bytes"),
        ("not a dict", [good], plan.broker, MODEL, "must be a dict"),
        ("bad plan", dict(good, plan={"model": MODEL}), plan.broker, MODEL, "lacks"),
        ("subkey not a str", good, 42, MODEL, "stored under subkey"),
        ("broker without key", sign_plan(dataclasses.replace(plan), broker) | {
            "plan": {**good["plan"], "broker": "Qm" + "z" * 44}}, "Qm" + "z" * 44, MODEL, "no Ed25519"),
    ]


@pytest.mark.parametrize("case", rejections(), ids=lambda c: c[0])
def test_bad_plans_are_rejected(case):
    _, value, subkey, model, fragment = case
    with pytest.raises(PlanRejected, match=fragment):
        verify_plan(value, subkey, model)


def with_nodes(body, validators=(None, None), timeout: float = 30):
    async def main():
        nodes = [await start_node(host_maddrs=HOST, record_validator=validators[0])]
        try:
            for validator in validators[1:]:
                nodes.append(await start_node(initial_peers=await visible_maddrs(nodes[0]), host_maddrs=HOST,
                                              record_validator=validator))
            return await asyncio.wait_for(body(*nodes), timeout)
        finally:
            await asyncio.gather(*(n.shutdown() for n in nodes), return_exceptions=True)

    return asyncio.run(main())


def test_announce_then_fetch_plans_drops_bad_ones_once(caplog):
    alice, bob = Identity.generate(), Identity.generate()
    good = make_plan(alice, version=3)
    bad = make_plan(bob)

    async def body(first, second):
        assert await announce_plan(first, good, alice, ttl=30)
        value = sign_plan(bad, bob)
        value["plan"]["version"] = 9  # altered after signing
        await second.store(plans_key(MODEL), subkey=bad.broker, value=value, expiration_time=get_dht_time() + 30)
        with caplog.at_level(logging.WARNING, logger="swarm.discovery"):
            found = [await fetch_plans(second, MODEL), await fetch_plans(first, MODEL)]
        return found, await fetch_plans(first, "other-model")

    (from_second, from_first), other = with_nodes(body)
    assert from_second == from_first == [good]
    assert other == []
    assert sum("Dropped a plan" in r.message for r in caplog.records) == 1  # logged once, not per fetch


def member(owner: SwarmOwner, name: str) -> tuple[Identity, PrivateRecordValidator]:
    identity = Identity.generate()
    creds = owner.invite(identity.public_bytes, name, 3600)
    return identity, PrivateRecordValidator(MembershipVerifier(owner.public_info()), creds, identity)


def test_private_swarm_members_read_members_plans_only():
    owner = SwarmOwner.generate()
    (alice, alice_v), (_, bob_v) = member(owner, "alice"), member(owner, "bob")
    outsider = Identity.generate()  # signs its plan correctly, but is no member
    mine, theirs = make_plan(alice, version=1), make_plan(outsider, version=7)

    async def body(a, b, x):
        assert await announce_plan(a, mine, alice, ttl=30)
        await announce_plan(x, theirs, outsider, ttl=30)  # a plain store: members' validators refuse it
        await asyncio.sleep(0.2)
        return await fetch_plans(b, MODEL), await fetch_plans(x, MODEL)

    members_see, outsider_sees = with_nodes(body, validators=(alice_v, bob_v, None))
    assert members_see == [mine]
    assert mine not in outsider_sees  # sealed for members
