"""Synthetic swarms for tests, benchmarks and simulations: peers on several sites, sparse measured links.

Seeded (``random.Random(seed)``): the same arguments give the same swarm. Each peer measures at most
``links_per_peer`` links (like a record's table), most of them inside its site; links inside a site are fast, links
between sites slow, so a planner that follows measured links must find the sites.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from swarm.plan.linkview import LinkView
from swarm.plan.types import PlanPeer

_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def peer_id(index: int, prefix: str = "12D3KooW") -> str:
    """A valid (base58, libp2p-sized) peer id for ``index``: distinct indices give distinct ids, sorted alike."""
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    digits = ""
    while True:
        index, r = divmod(index, 58)
        digits = _B58[r] + digits
        if index == 0:
            break
    return prefix + digits.rjust(12, "1")


@dataclass(frozen=True)
class Site:
    """A site: ``share`` of the peers, links inside at ``bandwidth`` bits/s and ``rtt`` s."""

    share: float
    bandwidth: float
    rtt: float


@dataclass(frozen=True)
class Swarm:
    peers: tuple[PlanPeer, ...]
    links: LinkView
    site_of: dict[str, int]


DEFAULT_SITES = (Site(0.4, 10e9, 0.001), Site(0.3, 1e9, 0.005), Site(0.2, 100e6, 0.01), Site(0.1, 20e6, 0.02))


def synthetic_swarm(n: int, num_blocks: int, *, seed: int = 0, sites: tuple[Site, ...] = DEFAULT_SITES,
                    links_per_peer: int = 8, outside: float = 0.1, between: tuple[float, float] = (50e6, 0.04)
                    ) -> Swarm:
    """``n`` peers spread over ``sites``; memory from 2 blocks to the whole model (log-uniform), compute 1-20 ms
    per token per block forward (backward 2x); each peer measures ``links_per_peer`` random links, a fraction
    ``outside`` of them to another site (at ``between`` = (bits/s, rtt)), measured values within +-10 %."""
    rng = random.Random(seed)
    ids = [peer_id(i) for i in range(n)]
    weights = [s.share for s in sites]
    site_of = {pid: rng.choices(range(len(sites)), weights)[0] for pid in ids}
    members: dict[int, list[str]] = {}
    for pid in ids:
        members.setdefault(site_of[pid], []).append(pid)
    peers = []
    for pid in ids:
        memory = max(2, min(num_blocks, round(2 * (num_blocks / 2) ** rng.random())))
        forward = 0.001 * 20 ** rng.random()
        peers.append(PlanPeer(pid, forward, 2 * forward, memory))
    links: dict[tuple[str, str], tuple[float, float]] = {}
    for pid in ids:
        home = members[site_of[pid]]
        for _ in range(links_per_peer):
            if rng.random() < outside or len(home) < 2:
                other = rng.choice(ids)
                bandwidth, rtt = between
                if site_of[other] == site_of[pid]:
                    bandwidth, rtt = sites[site_of[pid]].bandwidth, sites[site_of[pid]].rtt
            else:
                other = rng.choice(home)
                bandwidth, rtt = sites[site_of[pid]].bandwidth, sites[site_of[pid]].rtt
            if other != pid:
                links[(pid, other)] = (bandwidth * rng.uniform(0.9, 1.1), rtt * rng.uniform(0.9, 1.1))
    return Swarm(tuple(peers), LinkView(links), site_of)
