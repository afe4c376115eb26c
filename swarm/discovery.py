"""The only code that reads or writes the DHT: announce a record, fetch a snapshot of the swarm."""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path

from hivemind.dht.node import DHTNode
from hivemind.dht.validation import RecordValidatorBase
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr

from privacy.files import write_private
from privacy.identity import Identity
from privacy.peer_ids import libp2p_private_key, peer_id_of
from swarm import safe_msgpack
from swarm.keys import peers_key, plans_key
from swarm.lan import LanPresence
from swarm.nat import NatOptions, SwarmP2P, circuit_addrs
from swarm.plan.signed import PlanRejected, sign_plan, verify_plan
from swarm.plan.types import Plan
from swarm.reachability import (
    DialBackService,
    Reachability,
    check_reachability,
    peer_ids_of,
    unreachable_message,
)
from swarm.records import PeerRecord
from swarm.startup_checks import IdentityClaim, StartupRefused, check_identity_offline, check_ports_free

__all__ = ["NatOptions", "StartupRefused", "SwarmNode", "announce", "announce_plan", "fetch_plans", "fetch_records",
           "fetch_swarm", "lan_presence", "meet", "start_node", "visible_maddrs"]

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT = 3.0  # seconds the daemon gets to unregister our handlers when the node stops
RELAY_WAIT = 30.0  # seconds a node behind NAT waits for a relay to carry a dial-back to it


async def announce(node: DHTNode, record: PeerRecord, ttl: float) -> bool:
    """Publish ``record`` under its model's key, with the peer id as subkey, valid for ``ttl`` seconds."""
    # the first replica's answer is enough: the rest of the stores finish in the background, so a slow or
    # overloaded DHT peer cannot hold up (and time out) the heartbeat
    return await node.store(
        peers_key(record.model), subkey=record.peer_id, value=record.to_wire(), expiration_time=get_dht_time() + ttl,
        await_all_replicas=False,
    )


class Snapshot(list[PeerRecord]):
    """What ``fetch_records`` returns: the readable records, and how many ``sealed`` ones it could not read
    (a private swarm's, when this node has no member credentials)."""

    def __init__(self, records: Iterable[PeerRecord] = (), sealed: int = 0) -> None:
        super().__init__(records)
        self.sealed = sealed


_warned_sealed: set[str] = set()  # models whose sealed records were already reported in the log


async def fetch_records(node: DHTNode, model: str) -> Snapshot:
    """A snapshot of every unexpired, valid record of ``model``, sorted by peer id (``Snapshot.sealed`` counts
    the records sealed for a private swarm's members, which this node cannot read).

    A malformed record, or one stored under another peer's subkey, is dropped and logged; it never raises.
    """
    found = await node.get(peers_key(model), latest=True)
    if found is None or not isinstance(found.value, dict):
        return Snapshot()
    records, sealed = [], 0
    for subkey, item in found.value.items():
        value = getattr(item, "value", None)
        if isinstance(value, dict) and {"nonce", "ct", "sig"} <= value.keys():  # a private swarm's sealed record
            sealed += 1
            continue
        try:
            record = PeerRecord.from_wire(getattr(item, "value", None))
            if record.peer_id != subkey:
                raise ValueError(f"record of {record.peer_id} stored under subkey {subkey!r}")
            if record.model != model:
                raise ValueError(f"record for model {record.model!r} under key of {model!r}")
        except (ValueError, TypeError) as e:
            logger.warning("Dropped an invalid record under %s: %s", peers_key(model), e)
            continue
        records.append(record)
    if sealed and model not in _warned_sealed:  # once: callers that need a route raise PrivateSwarmError
        _warned_sealed.add(model)
        logger.warning("%d record(s) under %s are sealed: this is a private swarm; join it with --private "
                       "CREDENTIALS --identity_path ID from its owner's `swarm invite`", sealed, peers_key(model))
    return Snapshot(sorted(records, key=lambda r: r.peer_id), sealed)


async def announce_plan(node: DHTNode, plan: Plan, identity: Identity, ttl: float) -> bool:
    """Publish ``plan`` signed by ``identity`` (its broker) under the model's plans key, subkey = the broker's peer
    id, valid for ``ttl`` seconds. In a private swarm the node's record validator also seals it for members."""
    return await node.store(
        plans_key(plan.model), subkey=plan.broker, value=sign_plan(plan, identity),
        expiration_time=get_dht_time() + ttl, await_all_replicas=False,
    )


_warned_plans: dict[tuple[str, str], None] = {}  # (subkey, reason) of plans already reported in the log
_MAX_WARNED = 1024


async def fetch_plans(node: DHTNode, model: str) -> list[Plan]:
    """Every unexpired plan of ``model`` whose broker signed it and stored it under its own peer id, sorted by
    broker. Anything else (malformed, forged, misplaced, another model's, sealed for a private swarm's members)
    is dropped, logged once; it never raises."""
    found = await node.get(plans_key(model), latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    plans = []
    for subkey, item in found.value.items():
        value = getattr(item, "value", None)
        if isinstance(value, dict) and {"nonce", "ct", "sig"} <= value.keys():  # sealed: not a member
            continue
        try:
            plans.append(verify_plan(value, subkey, model))
        except PlanRejected as e:
            warned = (str(subkey)[:80], str(e)[:200])
            if warned not in _warned_plans:
                if len(_warned_plans) >= _MAX_WARNED:
                    _warned_plans.pop(next(iter(_warned_plans)))
                _warned_plans[warned] = None
                logger.warning("Dropped a plan under %s: %s", plans_key(model), e)
    return sorted(plans, key=lambda p: (p.broker, p.run_id))


async def fetch_swarm(node: DHTNode, model: str, timeout: float) -> tuple[Snapshot, list[Plan]]:
    """What ``swarm status`` and ``swarm monitor`` show of ``model``: its records and its plans, each lookup within
    ``timeout`` seconds (``asyncio.TimeoutError`` beyond)."""
    records = await asyncio.wait_for(fetch_records(node, model), timeout)
    return records, await asyncio.wait_for(fetch_plans(node, model), timeout)


async def meet(node: DHTNode, peer_id: str, maddrs: Sequence[str]) -> None:
    """Add a node found on the LAN to our routing table, and us to its (a DHT ping), unless we know it already."""
    peer = PeerID.from_base58(peer_id)
    if peer == node.peer_id or peer in node.protocol.routing_table:
        return
    await node.p2p._client.connect(peer, [Multiaddr(m.split("/p2p/")[0]) for m in maddrs])  # the daemon wants no /p2p/
    if await node.protocol.call_ping(peer) is not None:
        logger.info("Met %s on the LAN", peer_id)


async def lan_presence(node: DHTNode, host_maddrs: Sequence[str]) -> LanPresence:
    """Advertise ``node`` on the LAN (``swarm.lan``) and meet every other node advertised there later."""
    return await LanPresence(str(node.peer_id), await visible_maddrs(node), host_maddrs,
                             found=lambda peer_id, maddrs: meet(node, peer_id, maddrs)).start()


class SwarmNode(DHTNode):
    """A ``DHTNode`` that holds its identity file's :class:`IdentityClaim` until it shuts down, answers others'
    reachability checks unless it is a client, and knows how reachable it is itself."""

    identity_claim: IdentityClaim | None = None
    dial_back: DialBackService | None = None
    reachability: Reachability | None = None  # what the helpers answered, if the node checked
    relayed: bool = False  # reachable only through relays (then a DHT client, announcing relayed addresses)

    async def shutdown(self) -> None:
        """Stop the node and its daemon; a daemon that died first (Ctrl-C reaches it too) is not waited for."""
        self.is_alive = False
        try:
            if self.dial_back is not None:
                await self.dial_back.detach()
            try:  # unregisters our handlers from the daemon, whose answer never comes if it is gone
                await asyncio.wait_for(self.protocol.shutdown(), SHUTDOWN_TIMEOUT)
            except Exception as e:
                logger.debug("the p2p daemon did not unregister our handlers (%r); stopping it anyway", e)
            if self._should_shutdown_p2p:
                await self.p2p.shutdown()
                _retrieve_control_errors(self.p2p)
        finally:
            if self.identity_claim is not None:
                self.identity_claim.release()


def _retrieve_control_errors(p2p: P2P) -> None:
    """Read what the daemon connection's tasks died of when the daemon went first: hivemind never does, and
    asyncio would log each as "Task exception was never retrieved"."""
    control = getattr(getattr(p2p, "_client", None), "control", None)
    for task in (getattr(control, "_read_task", None), getattr(control, "_write_task", None)):
        if isinstance(task, asyncio.Future) and task.done() and not task.cancelled() and task.exception():
            logger.debug("the p2p daemon's connection ended with %r (the daemon stopped first)", task.exception())


async def start_node(
    *,
    initial_peers: Sequence[str] = (),
    host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
    announce_maddrs: Sequence[str] = (),
    identity_path: str | Path | None = None,
    identity: Identity | None = None,
    client_mode: bool = False,
    wait_timeout: float = 5.0,
    record_validator: RecordValidatorBase | None = None,
    nat: NatOptions | None = None,
    check_reachability: bool = False,
) -> SwarmNode:
    """Start a DHT node with its own p2p daemon, joined to ``initial_peers`` (none: a new swarm).

    The node's peer id is the public key of its Ed25519 identity: ``identity`` if given (already loaded by the
    caller, from ``identity_path`` if that is given too), else the one in ``identity_path`` (created, mode 0600,
    if missing; the id then survives restarts), else one the daemon makes up. A client can check a peer's
    handshake against the id it dialled. ``record_validator`` (a private swarm's, from ``privacy.admission``)
    signs, encrypts and checks every record.

    Refuses to start (:class:`StartupRefused`) when a fixed port of ``host_maddrs`` is taken, and, with
    ``identity_path``, when another node on this machine runs with that file (it stays locked until
    ``shutdown``) or a node with this peer id is already reachable through ``initial_peers``.

    ``nat`` has the relay options (default: relays on, no auto-relay; a client never takes relay slots). With
    ``check_reachability`` (a node that serves: stage peers, also as DHT clients), a node that joins a swarm
    asks its initial peers to dial it back
    (``swarm.reachability``) unless ``nat.force_reachability`` is set: a node they cannot dial restarts behind
    its relays (auto-relay; a DHT client announcing relayed addresses, checked through a relay) or, with relays
    off, is refused with what to do; ``force_reachability="private"`` goes behind the relays without the direct
    check. Every node that is not a client answers others' checks.
    """
    nat = nat or NatOptions()
    if client_mode and not check_reachability:  # a client: it only dials out
        nat = nat.for_client()
    safe_msgpack.install()  # else one DHT message of ~200 nested tuples segfaults this process
    check_ports_free(host_maddrs)
    claim = None
    if identity_path is not None:
        if identity is None:
            identity = Identity.load_or_create(identity_path)
        claim = IdentityClaim(identity_path)
    try:
        if claim is not None and initial_peers:
            await check_identity_offline(peer_id_of(identity.public_bytes), identity_path, initial_peers)
        create = dict(initial_peers=initial_peers, host_maddrs=host_maddrs, identity=identity,
                      wait_timeout=wait_timeout, record_validator=record_validator)
        checked = check_reachability and bool(initial_peers)  # a node that serves (a DHT client too)
        if checked and nat.force_reachability == "private":  # known to be behind NAT: straight to the relays
            if not (nat.use_relay and nat.use_auto_relay):
                raise StartupRefused(
                    "--force_reachability private says this peer is behind NAT, where nobody can dial it, and with "
                    "--no_relay or --no_auto_relay it takes no relay slots either, so no client could reach it: drop "
                    "--no_relay / --no_auto_relay, or forward a TCP port and pass --announce_maddrs "
                    "/ip4/YOUR_PUBLIC_IP/tcp/PORT with --force_reachability auto (checked) or public")
            node = await _start_relayed(create, nat, None)
        else:
            node = await _create_node(**create, announce_maddrs=announce_maddrs, client_mode=client_mode, nat=nat)
            if checked and nat.force_reachability is None:
                node = await _ensure_reachable(node, create, nat)
        if not client_mode and not node.relayed:
            node.dial_back = DialBackService(node.p2p)
            await node.dial_back.attach()
    except BaseException:
        if claim is not None:
            claim.release()
        raise
    node.identity_claim = claim
    return node


async def _ensure_reachable(node: SwarmNode, create: dict, nat: NatOptions) -> SwarmNode:
    """Check that the initial peers can dial ``node``; if not, restart it behind relays or refuse to start."""
    try:
        addrs = await visible_maddrs(node)
        report = await check_reachability(node.p2p, peer_ids_of(create["initial_peers"]), addrs)
        node.reachability = report
        if report.direct is None:
            logger.warning("Could not check whether other peers can dial this one (no initial peer answered: old "
                           "versions, or busy); starting anyway. If clients cannot reach it, see --force_reachability "
                           "private (serve through relays)")
            return node
        if report.direct:
            logger.info("Reachable directly at %s (checked by %d peer(s))", " ".join(addrs), len(report.answers))
            return node
        if not (nat.use_relay and nat.use_auto_relay):
            raise StartupRefused(unreachable_message(report))
    except BaseException:
        await node.shutdown()
        raise
    logger.info("Not reachable directly:\n  %s\nRestarting behind relays", report.describe())
    await node.shutdown()
    return await _start_relayed(create, nat, report)


async def _start_relayed(create: dict, nat: NatOptions, direct: Reachability | None) -> SwarmNode:
    """A node behind its relays: forced private (slots reserved at once), a DHT client, announcing relayed
    addresses, and checked: a relay must dial it through itself."""
    relays = nat.trusted_relays(create["initial_peers"])
    node = await _create_node(**create, announce_maddrs=circuit_addrs(relays), client_mode=True,
                              nat=replace(nat, force_reachability="private"))
    try:
        node.relayed, node.reachability = True, direct
        await _check_relayed(node, relays, direct)
    except BaseException:
        await node.shutdown()
        raise
    return node


async def _check_relayed(node: SwarmNode, relays: Sequence[str], direct: Reachability | None) -> None:
    """Wait until one of ``relays`` dials ``node`` through itself (its slot there is reserved), or refuse."""
    loop = asyncio.get_running_loop()
    deadline, pause = loop.time() + RELAY_WAIT, 0.5
    while True:
        await asyncio.sleep(pause)  # the daemon reserves its slots right after it starts
        pause = min(2 * pause, 8.0)  # each try is one of the relay's few checks per minute for us
        addrs = await visible_maddrs(node)
        report = await check_reachability(node.p2p, peer_ids_of(relays), (), relayed=True)
        if report.relayed:
            used = [a.helper for a in report.answers if a.relayed and a.relayed.ok]
            logger.info("Not reachable directly: serving through relay(s) (%s dialled this peer through itself); "
                        "announced addresses: %s", " ".join(used), " ".join(addrs))
            return
        if loop.time() > deadline:
            before = direct.describe() if direct else "(the direct check was skipped: --force_reachability private)"
            raise StartupRefused(
                f"this peer is not reachable directly, and no relay carried a dial-back to it within "
                f"{RELAY_WAIT:.0f} s:\n  {before}\n  {report.describe()}\nCheck that the relays "
                f"({' '.join(relays)}) run `swarm dht` (they relay by default) or name others with --relays; or "
                f"forward a TCP port to this machine and pass --host_maddrs /ip4/0.0.0.0/tcp/PORT "
                f"--announce_maddrs /ip4/YOUR_PUBLIC_IP/tcp/PORT")


async def _create_node(*, initial_peers: Sequence[str], host_maddrs: Sequence[str], announce_maddrs: Sequence[str],
                       identity: Identity | None, client_mode: bool, wait_timeout: float,
                       record_validator: RecordValidatorBase | None, nat: NatOptions) -> SwarmNode:
    with tempfile.TemporaryDirectory(prefix="fusionswarm-id-") as tmp:
        options = {}
        if identity is not None:  # the daemon reads the key once at start; the file goes with the folder
            key_path = os.path.join(tmp, "p2p.key")
            write_private(key_path, libp2p_private_key(identity), what="libp2p key")
            # hivemind's "is this identity already online" probe reads only RSA keys: start_node does its own
            options.update(identity_path=key_path, check_if_identity_free=False)
        try:
            p2p = await SwarmP2P.create_with(
                nat.daemon_flags(initial_peers),
                initial_peers=list(initial_peers),
                host_maddrs=list(host_maddrs),
                announce_maddrs=list(announce_maddrs) or None,
                dht_mode="client" if client_mode else "server",
                **nat.create_kwargs(initial_peers),
                **options,
            )
        except Exception as e:
            raise RuntimeError(f"could not start the p2p daemon ({e}); {_hint(initial_peers)}") from e
        try:
            node = await SwarmNode.create(
                p2p=p2p,
                initial_peers=list(initial_peers),
                client_mode=client_mode,
                wait_timeout=wait_timeout,
                record_validator=record_validator,
            )
        except BaseException as e:
            await p2p.shutdown()
            if not isinstance(e, Exception):
                raise
            raise RuntimeError(f"could not start or join the DHT ({e}); {_hint(initial_peers)}") from e
        node._should_shutdown_p2p = True  # the node owns its daemon
        return node


def _hint(initial_peers: Sequence[str]) -> str:
    return ("check that the --initial_peers line is complete and that the bootstrap peer is running" if initial_peers
            else "check --host_maddrs (e.g. /ip4/127.0.0.1/tcp/0) and that the port is free")


async def visible_maddrs(node: DHTNode) -> list[str]:
    """Full multiaddrs (with /p2p/PEER_ID) that other peers can pass as --initial_peers."""
    return [str(m) for m in await node.get_visible_maddrs()]
