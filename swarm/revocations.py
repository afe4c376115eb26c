"""Spread a private swarm's revocations through its DHT, and apply the newest one a node finds.

A revocation is signed by the swarm owner, so anyone may carry it: ``swarm revoke`` stores it once, and every
member re-stores the newest it knows under its own subkey on each heartbeat, so it outlives the owner's node.
Applying one makes the node refuse the revoked members' proofs and records, and purges their records from
its DHT storage (hivemind never revalidates what it already stored).
"""

from __future__ import annotations

import asyncio
import logging

from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time

from privacy.errors import MembershipError
from privacy.membership import MembershipVerifier, Revocation
from privacy.records import PrivateRecordValidator
from swarm.keys import revocations_key

logger = logging.getLogger(__name__)


async def publish_revocation(node: DHTNode, revocation: Revocation, ttl: float) -> bool:
    """Store ``revocation`` under this node's peer id for ``ttl`` seconds."""
    return await node.store(revocations_key(), subkey=str(node.peer_id), value=revocation.to_bytes(),
                            expiration_time=get_dht_time() + ttl, await_all_replicas=False)


async def fetch_revocations(node: DHTNode) -> list[Revocation]:
    """Every well-formed revocation in the DHT (their signatures are checked when applied)."""
    found = await node.get(revocations_key(), latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    revocations = []
    for item in found.value.values():
        try:
            revocations.append(Revocation.from_bytes(getattr(item, "value", b"")))
        except (MembershipError, ValueError, TypeError) as e:
            logger.debug("ignoring a malformed revocation record: %s", e)
    return revocations


async def sync_revocations(node: DHTNode, verifier: MembershipVerifier, validator: PrivateRecordValidator | None,
                           ttl: float) -> bool:
    """Apply the newest valid revocation found, purge newly refused records, re-publish the newest known.

    Returns whether a new revocation was applied.
    """
    before = verifier.revocation
    for revocation in sorted(await fetch_revocations(node), key=lambda r: r.issued_at):
        try:
            verifier.update_revocations(revocation)
        except MembershipError as e:
            logger.warning("ignoring a revocation found in the DHT: %s", e)
    changed = verifier.revocation is not before
    if changed and validator is not None:
        validator.purge_storage(node.protocol.storage)
        validator.purge_storage(node.protocol.cache)
    if verifier.revocation is not None:
        await publish_revocation(node, verifier.revocation, ttl)
    return changed


async def keep_revocations(node: DHTNode, admission, *, period: float) -> None:
    """Forever: every ``period`` s, sync ``admission``'s revocations with the DHT (nothing in a public swarm)."""
    verifier = getattr(admission, "verifier", None)
    if verifier is None:
        return
    while True:
        try:
            await asyncio.wait_for(sync_revocations(node, verifier, admission.record_validator(), ttl=2 * period + 1),
                                   timeout=max(period, 10.0))
        except Exception as e:
            logger.warning("could not sync revocations with the DHT (%r); retrying in %.0f s", e, period)
        await asyncio.sleep(period)
