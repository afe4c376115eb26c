"""Fuzz the plan records a broker (or anyone) stores in the DHT: ``verify_plan`` takes any value hivemind's msgpack
yields and either returns a checked plan or raises ``PlanRejected``, nothing else."""

from __future__ import annotations

import msgpack
from fuzz_strategies import DEEP, INTS, SCALARS, VALUES, pack, shaped_maps
from hypothesis import given
from hypothesis import strategies as st

from privacy.identity import Identity
from privacy.peer_ids import peer_id_of
from swarm.plan.signed import PlanRejected, sign_plan, verify_plan
from swarm.plan.types import Assignment, Group, Plan

BROKER = Identity.from_private_bytes(b"\x07" * 32)
BROKER_ID = peer_id_of(BROKER.public_bytes)
PEERS = ["12D3KooW" + c * 44 for c in "ABC"]
GOOD = Plan(model="llama-tiny", num_blocks=4, version=3, broker=BROKER_ID, made_at=1.7e9, run_id="r",
            groups=(Group((Assignment(PEERS[0], 0, 2), Assignment(PEERS[1], 2, 4)), 0.01),), backups=(PEERS[2],))
SIGNED = sign_plan(GOOD, BROKER)

STAGES = st.lists(st.lists(st.sampled_from(PEERS) | INTS | st.text(max_size=60), min_size=3, max_size=3)
                  | VALUES, max_size=5)
GROUPS = st.lists(shaped_maps({"s": st.floats() | INTS, "stages": STAGES}) | SCALARS, max_size=4)
PLAN_FIELDS = {
    "model": st.sampled_from(["llama-tiny", ""]) | st.text(max_size=300), "blocks": INTS, "version": INTS,
    "broker": st.sampled_from([BROKER_ID, PEERS[0]]) | st.text(max_size=90), "made_at": st.floats() | INTS,
    "objective": st.sampled_from(["training", "inference", "x"]), "run": st.text(max_size=300),
    "backups": st.lists(st.sampled_from(PEERS) | SCALARS, max_size=4), "groups": GROUPS,
}


@st.composite
def mutated_good(draw) -> dict:
    """The signed good plan with a few of its fields replaced, dropped or deeply nested."""
    wire = dict(SIGNED["plan"])
    for name in draw(st.lists(st.sampled_from(sorted(wire)), max_size=3, unique=True)):
        how = draw(st.sampled_from(["typed", "any", "deep", "drop"]))
        if how == "drop":
            wire.pop(name)
        elif how == "deep":
            wire[name] = msgpack.unpackb(pack(draw(DEEP)))
        else:
            wire[name] = draw(PLAN_FIELDS[name] if how == "typed" else VALUES)
    return {"plan": wire, "sig": SIGNED["sig"]}


VALUES_OF_PLANS = (mutated_good() | shaped_maps({"plan": shaped_maps(PLAN_FIELDS), "sig": st.binary(max_size=70)})
                   | VALUES)


@given(VALUES_OF_PLANS, st.sampled_from([BROKER_ID, PEERS[0], 7, None]))
def test_verify_plan_accepts_only_the_signed_plan(value, subkey):
    try:
        plan = verify_plan(value, subkey, "llama-tiny")
    except PlanRejected:
        return
    assert plan == GOOD and subkey == BROKER_ID  # nothing else carries the broker's signature


def test_the_good_plan_passes():
    assert verify_plan(SIGNED, BROKER_ID, "llama-tiny") == GOOD
