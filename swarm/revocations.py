"""Spread a private swarm's revocations through its DHT, and apply the newest one a node finds.

A revocation is signed by the swarm owner, so anyone may carry it: ``swarm revoke`` stores it once, and every
member re-stores the newest it knows under its own subkey on each heartbeat, so it outlives the owner's node.
Applying one makes the node refuse the revoked members' proofs and records, and purges their records from
its DHT storage (hivemind never revalidates what it already stored). A node that finds its own certificate
revoked (or expired) stops: ``keep_revocations`` raises, and the peer, bootstrap node or client it runs in with it.
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


def check_membership(admission) -> None:
    """Raise ``MembershipError`` if this node's own certificate was revoked or has expired (no-op if public)."""
    verifier, credentials = getattr(admission, "verifier", None), getattr(admission, "credentials", None)
    if verifier is None or credentials is None:
        return
    try:
        verifier.verify(credentials.certificate)
    except MembershipError as e:
        raise MembershipError(
            f"this node's membership ended: {e}. Other members refuse its calls and records, so it stops; ask the "
            f"swarm owner for a new invite (`swarm invite`) and restart with the new --private CREDENTIALS") from e


async def keep_revocations(node: DHTNode, admission, *, period: float) -> None:
    """Every ``period`` s, sync ``admission``'s revocations with the DHT (nothing in a public swarm).

    Runs until cancelled, or raises ``MembershipError`` (``check_membership``) once this node's own certificate
    is revoked or expired: the caller stops the node (see ``serve_until``).
    """
    verifier = getattr(admission, "verifier", None)
    if verifier is None:
        return
    while True:
        try:
            await asyncio.wait_for(sync_revocations(node, verifier, admission.record_validator(), ttl=2 * period + 1),
                                   timeout=max(period, 10.0))
        except Exception as e:
            logger.warning("could not sync revocations with the DHT (%r); retrying in %.0f s", e, period)
        check_membership(admission)
        await asyncio.sleep(period)


async def serve_until(stop: asyncio.Event, watch: asyncio.Future) -> None:
    """Wait for ``stop``; if ``watch`` (e.g. ``keep_revocations``) raises first, raise that: the node must stop."""
    stopped = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait({stopped, watch}, return_when=asyncio.FIRST_COMPLETED)
        if watch in done and not watch.cancelled() and watch.exception() is not None:
            raise watch.exception()
        await stopped
    finally:
        stopped.cancel()
