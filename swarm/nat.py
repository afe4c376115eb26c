"""How a node crosses NAT: hivemind's relay and reachability options, and the p2p daemon that gets all of them.

libp2p relays (circuit v2): a node behind NAT keeps a connection open to a *relay* (a reachable node), reserves a
slot there and announces ``RELAY_ADDR/p2p/RELAY_ID/p2p-circuit``; others dial it through the relay. What this
module decides, from what the daemon (hivemind's go-libp2p-daemon) does:

* Every node with relays on (``use_relay``, the default) can dial through relays, and also relays for others.
  A node forced ``public`` (``swarm dht`` by default) relays with :data:`RELAY_LIMITS` per circuit; any other
  node relays with libp2p's defaults (2 minutes and 128 KiB per circuit: too little to serve a model through).
* Auto-relay (``use_auto_relay``) reserves slots on the node's *trusted relays* only (``relays``, by default
  its ``--initial_peers``), at once: hivemind's own discovery would wait for 4 candidates or 3 minutes.
* libp2p's AutoNAT can only tell a node it is behind NAT when it has public addresses, so the reachability
  check (``swarm.reachability``) decides instead; a node found unreachable restarts its daemon with
  ``force_reachability="private"``, which makes auto-relay reserve its slots immediately.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from hivemind.p2p import P2P

__all__ = ["RELAY_LIMITS", "NatOptions", "SwarmP2P", "circuit_addrs"]

# what a relay forced public gives each circuit (the daemon's flags); libp2p's default is 2 min / 128 KiB
RELAY_LIMITS = {"relayTimeLimit": "2h0m0s", "relayDataLimit": 1 << 36, "relayMaxCircuits": 64}
REACHABILITY = ("public", "private")


@dataclass(frozen=True, kw_only=True)
class NatOptions:
    """A node's relay and NAT options, as hivemind's ``P2P.create`` and the p2p daemon take them."""

    use_relay: bool = True  # dial through relays, and relay for others
    use_auto_relay: bool = False  # reserve slots on ``relays`` to be reachable from behind NAT (not without relays)
    force_reachability: str | None = None  # "public" | "private": skip AutoNAT (and our reachability check)
    relays: tuple[str, ...] = ()  # trusted relays (full multiaddrs with /p2p/ID); default: the initial peers
    extra_flags: dict[str, Any] = field(default_factory=dict)  # more p2pd flags, e.g. RELAY_LIMITS

    def __post_init__(self) -> None:
        if self.force_reachability not in (None, *REACHABILITY):
            raise ValueError(f"force_reachability must be one of {REACHABILITY} or unset, got "
                             f"{self.force_reachability!r}")
        if not self.use_relay:  # no relays at all: no slots on them either
            object.__setattr__(self, "use_auto_relay", False)
        for maddr in self.relays:
            if "/p2p/" not in maddr or "p2p-circuit" in maddr:
                raise ValueError(f"relay {maddr!r} must be a relay's own full address /ip4/.../tcp/PORT/p2p/PEER_ID "
                                 f"(like an --initial_peers entry)")
        object.__setattr__(self, "relays", tuple(self.relays))

    def trusted_relays(self, initial_peers: Sequence[str]) -> tuple[str, ...]:
        """The relays auto-relay reserves slots on: ``relays``, else the initial peers."""
        return self.relays or tuple(initial_peers)

    def for_client(self) -> NatOptions:
        """A node that only dials out: relays to reach others, no slots of its own."""
        return replace(self, use_auto_relay=False)

    def create_kwargs(self, initial_peers: Sequence[str]) -> dict[str, Any]:
        """Keyword arguments of hivemind's ``P2P.create`` (and so of ``DHTNode.create``)."""
        kwargs: dict[str, Any] = dict(use_relay=self.use_relay, use_auto_relay=self.use_auto_relay)
        if self.force_reachability is not None:
            kwargs["force_reachability"] = self.force_reachability
        relays = self.trusted_relays(initial_peers)
        if self.use_auto_relay and relays:
            kwargs["trusted_relays"] = list(relays)
        return kwargs

    def daemon_flags(self, initial_peers: Sequence[str]) -> dict[str, Any]:
        """p2pd flags that hivemind's ``P2P.create`` has no argument for."""
        flags = dict(self.extra_flags)
        if self.use_auto_relay and self.trusted_relays(initial_peers):
            flags["relayDiscovery"] = False  # our relays only, reserved at once (not after 4 candidates or 3 min)
        if self.use_relay and self.force_reachability == "public":
            flags = {**RELAY_LIMITS, **flags}
        return flags


class SwarmP2P(P2P):
    """hivemind's ``P2P`` with more p2pd flags: ``await SwarmP2P.create_with(flags, **create_kwargs)``."""

    _pending_flags: dict[str, Any] = {}

    @classmethod
    async def create_with(cls, flags: dict[str, Any], **kwargs: Any) -> SwarmP2P:
        # P2P.create builds the command line with self._make_process_args; the flags ride on a fresh subclass so
        # that concurrent creations do not share them
        subclass = type(cls.__name__, (cls,), {"_pending_flags": dict(flags)})
        p2p = await subclass.create(**kwargs)
        assert isinstance(p2p, SwarmP2P)
        return p2p

    def _make_process_args(self, *args: Any, **kwargs: Any) -> list[str]:  # type: ignore[override]
        return P2P._make_process_args(*args, **{**kwargs, **self._pending_flags})

    def daemon_command(self) -> list[str]:
        """The p2pd command line this node runs (from ``/proc``; empty where there is none)."""
        try:
            with open(f"/proc/{self._child.pid}/cmdline", "rb") as f:
                return [a.decode() for a in f.read().split(b"\0") if a]
        except (OSError, AttributeError):
            return []


def circuit_addrs(relays: Sequence[str]) -> list[str]:
    """The addresses at which a node with a slot on each of ``relays`` is reachable (without its own /p2p/ID).

    libp2p announces relayed addresses only for relays with public addresses; these are announced explicitly,
    so that relays on private networks (a LAN, the testbed) work too.
    """
    return [f"{relay}/p2p-circuit" for relay in relays]
