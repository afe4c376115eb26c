"""Which links the broker knows: each peer measures a few neighbours when it joins (its datacenter site's peers
first, then peers of its region at random, as a record's link table holds ``swarm.records.MAX_LINKS`` rows), and
the hops of the pipelines it works in (real traffic). Everything else is priced with ``swarm.links``' defaults.
The measured figures are the simulated network's true ones."""

from __future__ import annotations

import random
from collections.abc import Callable

from swarm.links import DEFAULT_BANDWIDTH, DEFAULT_RTT
from swarm.records import MAX_LINKS
from swarm.simulation.network import Host


class _Bag:
    """A set with O(1) add, remove and uniform sampling."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self.index: dict[str, int] = {}

    def add(self, item: str) -> None:
        if item not in self.index:
            self.index[item] = len(self.items)
            self.items.append(item)

    def remove(self, item: str) -> None:
        i = self.index.pop(item, None)
        if i is None:
            return
        last = self.items.pop()
        if i < len(self.items):
            self.items[i] = last
            self.index[last] = i

    def sample(self, rng: random.Random, k: int) -> list[str]:
        return rng.sample(self.items, min(k, len(self.items)))


class KnownLinks:
    """The measured links among live peers, kept up to date as peers join, leave and work together."""

    def __init__(self, rng: random.Random, link: Callable[[Host, Host], tuple[float, float]],
                 per_peer: int = MAX_LINKS) -> None:
        self.rng, self.link, self.per_peer = rng, link, per_peer
        self.hosts: dict[str, Host] = {}
        self.near: dict[str, set[str]] = {}
        self.figures: dict[tuple[str, str], tuple[float, float]] = {}  # each measured directed link
        self._by_region: dict[str, _Bag] = {}
        self._by_site: dict[str, _Bag] = {}

    def join(self, peer_id: str, host: Host) -> None:
        self.hosts[peer_id] = host
        self.near.setdefault(peer_id, set())
        chosen: list[str] = []
        if host.datacenter:
            chosen = self._by_site.get(host.site, _Bag()).sample(self.rng, self.per_peer)
        rest = self.per_peer - len(chosen)
        if rest > 0:
            chosen += [p for p in self._by_region.get(host.region, _Bag()).sample(self.rng, rest + len(chosen))
                       if p not in chosen][:rest]
        for other in chosen:
            self.measure(peer_id, other)
        self._by_region.setdefault(host.region, _Bag()).add(peer_id)
        if host.datacenter:
            self._by_site.setdefault(host.site, _Bag()).add(peer_id)

    def leave(self, peer_id: str) -> None:
        host = self.hosts.pop(peer_id, None)
        if host is None:
            return
        for other in self.near.pop(peer_id, set()):
            self.near[other].discard(peer_id)
            self.figures.pop((peer_id, other), None)
            self.figures.pop((other, peer_id), None)
        self._by_region[host.region].remove(peer_id)
        if host.datacenter:
            self._by_site[host.site].remove(peer_id)

    def measure(self, a: str, b: str) -> None:
        """``a`` and ``b`` exchanged traffic: their link is known from now on (both directions)."""
        if a != b and a in self.hosts and b in self.hosts and b not in self.near[a]:
            self.near[a].add(b)
            self.near[b].add(a)
            self.figures[(a, b)] = self.link(self.hosts[a], self.hosts[b])
            self.figures[(b, a)] = self.link(self.hosts[b], self.hosts[a])

    def __call__(self, a: str, b: str) -> tuple[float, float]:
        """A ``LinkCost``: the measured ``a -> b``, else ``swarm.links``' defaults."""
        return self.figures.get((a, b), (DEFAULT_BANDWIDTH, DEFAULT_RTT))

    def table(self, among: set[str] | None = None) -> dict[tuple[str, str], tuple[float, float]]:
        """The measured directed links (bits/s, round trip s), all or those with both ends ``among``."""
        if among is None:
            return dict(self.figures)
        return {(a, b): self.figures[(a, b)] for a in among for b in self.near.get(a, ()) if b in among}
