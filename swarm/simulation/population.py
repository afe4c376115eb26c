"""Who is in the swarm: peers drawn from a mix of device classes, each on a home connection or in a datacenter.

A ``Mix`` says how likely each kind of peer is; ``Population.draw`` makes one with a fresh peer id, deterministic
for the population's random generator. A peer's ``PlanPeer`` is what the planner sees of it; ``load_s`` is how long
it takes to fetch a span's weights (over its downlink, or from its disk when that is slower).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from swarm.plan.types import PlanPeer
from swarm.simulation.devices import CATALOG, DeviceClass, ModelSpec, PeerFigures, figures
from swarm.simulation.network import DATACENTER_RATE, REGIONS, Host, datacenter_host, home_host

_BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


@dataclass(frozen=True)
class Kind:
    """One kind of peer in a mix: a device class, at homes or in datacenters, and its weight in the mix."""

    device: str
    weight: float
    datacenter: bool = False

    def __post_init__(self) -> None:
        if self.device not in CATALOG:
            raise ValueError(f"unknown device {self.device!r}; known: {sorted(CATALOG)}")
        if not self.weight > 0:
            raise ValueError(f"a kind's weight must be > 0, got {self.weight!r}")


# A heterogeneous volunteer swarm: mostly gaming GPUs at homes, some cloud GPUs, a few CPUs.
HETEROGENEOUS: tuple[Kind, ...] = (
    Kind("rtx3060", 12), Kind("rtx3080", 25), Kind("rtx3090", 15), Kind("rtx4090", 15), Kind("cpu", 10),
    Kind("t4", 10, datacenter=True), Kind("a100", 9, datacenter=True), Kind("h100", 4, datacenter=True),
)


@dataclass(frozen=True)
class SimPeer:
    peer_id: str
    device: DeviceClass
    host: Host
    figures: PeerFigures

    @cached_property
    def plan_peer(self) -> PlanPeer:
        return PlanPeer(self.peer_id, self.figures.forward_s, self.figures.backward_s, max(1, self.figures.max_blocks))

    @property
    def can_serve(self) -> bool:
        return self.figures.max_blocks >= 1

    def load_s(self, blocks: int, model: ModelSpec) -> float:
        """Seconds to fetch ``blocks`` blocks' weights."""
        rate = min(self.host.down_bps / 8, self.device.disk_bytes_per_s)
        return blocks * model.block_bytes / rate


def peer_id(rng: random.Random) -> str:
    """A libp2p-looking peer id (base58), unique with overwhelming probability."""
    value, digits = rng.getrandbits(258), []
    for _ in range(44):
        value, digit = divmod(value, 58)
        digits.append(_BASE58[digit])
    return "12D3KooW" + "".join(digits)


class Population:
    """Draws peers of ``mix`` for ``model``; datacenter peers fall in ``sites_per_region`` sites per region, each
    with a NIC rate of ``datacenter_rate`` bits/s (None: drawn in ``network.DATACENTER_RATE``)."""

    def __init__(self, rng: random.Random, model: ModelSpec, mix: Sequence[Kind] = HETEROGENEOUS, *,
                 memory: str = "adapters", regions: Sequence[str] = REGIONS, sites_per_region: int = 3,
                 datacenter_rate: float | None = None) -> None:
        if not mix:
            raise ValueError("a mix needs at least one kind")
        self.rng, self.model, self.mix, self.memory = rng, model, tuple(mix), memory
        self.regions = tuple(regions)
        self.sites = {(region, i): (rng.uniform(-2000, 2000), rng.uniform(-2000, 2000),
                                    datacenter_rate or rng.uniform(*DATACENTER_RATE))
                      for region in self.regions for i in range(sites_per_region)}
        self._weights = [k.weight for k in self.mix]

    def draw(self, kind: Kind | None = None) -> SimPeer:
        """One new peer (of ``kind``, else of a kind drawn from the mix)."""
        kind = kind or self.rng.choices(self.mix, self._weights)[0]
        pid = peer_id(self.rng)
        region = self.rng.choice(self.regions)
        if kind.datacenter:
            index = self.rng.randrange(len(self.sites) // len(self.regions))
            x, y, rate = self.sites[(region, index)]
            host = datacenter_host(f"dc-{region}-{index}", region, rate, (x, y))
        else:
            host = home_host(self.rng, region, pid)
        device = CATALOG[kind.device]
        return SimPeer(pid, device, host, figures(device, self.model, self.memory))
