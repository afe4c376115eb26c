"""A plan as the DHT carries it: the plan's wire dict and its broker's Ed25519 signature over a domain-separated
encoding, stored under the broker's own peer id.

The signature covers the plan re-encoded from its parsed fields (``Plan.to_wire`` has a fixed key order), so a
reader checks exactly what it will act on, however the value was packed on the way. The peer id *is* the broker's
public key (``privacy.peer_ids``), so a reader needs nothing but the record to check who made the plan.
"""

from __future__ import annotations

from typing import Any

import msgpack

from privacy.errors import PrivacyError
from privacy.identity import SIGNATURE_SIZE, Identity, verify_signature
from privacy.peer_ids import peer_id_of, public_key_of
from swarm.plan.types import Plan

SIGN_DOMAIN = "fusionswarm/plan/signature/v1"


class PlanRejected(ValueError):
    """A plan record that a reader must not follow: malformed, badly signed, misplaced or for another model."""


def signed_payload(plan: Plan) -> bytes:
    """The bytes a broker signs: the domain, then the plan's canonical wire encoding."""
    return msgpack.packb([SIGN_DOMAIN, plan.to_wire()], use_bin_type=True)


def sign_plan(plan: Plan, identity: Identity) -> dict[str, Any]:
    """The DHT value of ``plan``, signed by ``identity``; ``plan.broker`` must be that identity's peer id."""
    own = peer_id_of(identity.public_bytes)
    if plan.broker != own:
        raise ValueError(f"a plan names broker {plan.broker!r}, but it is signed by {own}: set Plan.broker to the "
                         f"signer's peer id")
    return {"plan": plan.to_wire(), "sig": identity.sign(signed_payload(plan))}


def verify_plan(value: Any, subkey: Any, model: str) -> Plan:
    """The plan in a DHT value stored under ``subkey``, checked: well formed, for ``model``, stored under its
    broker's peer id and signed by that broker. Raises :class:`PlanRejected` saying why not."""
    if not isinstance(value, dict) or not {"plan", "sig"} <= value.keys():
        raise PlanRejected(f"a plan record must be a dict with 'plan' and 'sig', got {_kind(value)}")
    signature = value["sig"]
    if not isinstance(signature, bytes) or len(signature) != SIGNATURE_SIZE:
        raise PlanRejected(f"a plan's signature must be {SIGNATURE_SIZE} bytes")
    try:
        plan = Plan.from_wire(value["plan"])
    except (ValueError, TypeError) as e:
        raise PlanRejected(str(e)) from None
    if plan.model != model:
        raise PlanRejected(f"a plan for model {plan.model[:64]!r} under the key of {model!r}")
    if not isinstance(subkey, str) or plan.broker != subkey:
        raise PlanRejected(f"a plan of broker {plan.broker[:64]!r} stored under subkey {str(subkey)[:64]!r}")
    try:
        public = public_key_of(plan.broker)
    except PrivacyError as e:
        raise PlanRejected(f"the plan's broker has no Ed25519 peer id: {e}") from None
    if not verify_signature(public, signed_payload(plan), signature):
        raise PlanRejected(f"the plan of broker {plan.broker} is not signed by it (forged or altered)")
    return plan


def _kind(value: Any) -> str:
    return f"a dict with keys {sorted(map(str, value))[:8]}" if isinstance(value, dict) else type(value).__name__
