"""A simulated wide-area network: hosts at homes or in datacenters, placed in regions, and the link between any two.

No pair is stored: a link is computed from its two ends. Bandwidth ``a -> b`` is the smaller of ``a``'s uplink and
``b``'s downlink (and ``WAN_CAP`` between datacenters of different sites). The round trip is both ends' access
latency plus propagation: distance within a region (light in fibre, with a routing detour), or the base round trip
between two regions. Inside one datacenter site: ``SITE_RTT``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

MBIT = 1e6
GBIT = 1e9

FIBRE_KM_PER_S = 200_000.0  # light in fibre, one way
DETOUR = 1.5  # routes are longer than the straight line
REGION_RADIUS_KM = 2500.0  # hosts of a region lie in a disc this wide (a continent)
REGION_RTT = {("eu", "na"): 0.080, ("asia", "eu"): 0.150, ("asia", "na"): 0.120}  # base round trips between regions
REGIONS = ("na", "eu", "asia")
SITE_RTT = 0.0002  # inside one datacenter
WAN_CAP = 10 * GBIT  # between datacenters of different sites

# Home access (log-uniform): 50-1000 Mbit/s down, 10-100 up (never above down); last mile 2-15 ms each way.
HOME_DOWN = (50 * MBIT, 1000 * MBIT)
HOME_UP = (10 * MBIT, 100 * MBIT)
HOME_ACCESS_RTT = (0.004, 0.030)
DATACENTER_RATE = (10 * GBIT, 100 * GBIT)


@dataclass(frozen=True)
class Host:
    """Where a peer runs: its ``site`` (a datacenter's name, or ``home:<peer>``), region, position in the region
    (km), access rates (bits/s) and access round trip (s)."""

    site: str
    region: str
    x_km: float
    y_km: float
    up_bps: float
    down_bps: float
    access_rtt: float = 0.0

    @property
    def datacenter(self) -> bool:
        return not self.site.startswith("home:")


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def _position(rng: random.Random) -> tuple[float, float]:
    radius, angle = REGION_RADIUS_KM * math.sqrt(rng.random()), rng.uniform(0, 2 * math.pi)
    return radius * math.cos(angle), radius * math.sin(angle)


def home_host(rng: random.Random, region: str, name: str) -> Host:
    """A host on a home connection in ``region``."""
    down = _log_uniform(rng, *HOME_DOWN)
    up = min(down, _log_uniform(rng, *HOME_UP))
    x, y = _position(rng)
    return Host(f"home:{name}", region, x, y, up, down, rng.uniform(*HOME_ACCESS_RTT))


def datacenter_host(site: str, region: str, rate_bps: float, position: tuple[float, float] = (0.0, 0.0)) -> Host:
    """A host in datacenter ``site`` with a ``rate_bps`` NIC both ways."""
    return Host(site, region, position[0], position[1], rate_bps, rate_bps, 0.0)


def region_rtt(a: str, b: str) -> float:
    """The base round trip between two regions (0 inside one)."""
    if a == b:
        return 0.0
    key = (a, b) if a < b else (b, a)
    if key not in REGION_RTT:
        raise ValueError(f"no round trip known between regions {a!r} and {b!r}; known: {sorted(REGION_RTT)}")
    return REGION_RTT[key]


def link(a: Host, b: Host) -> tuple[float, float]:
    """(bandwidth bits/s, round trip s) of the directed link ``a -> b``."""
    if a.site == b.site:
        return min(a.up_bps, b.down_bps), SITE_RTT
    bandwidth = min(a.up_bps, b.down_bps)
    if a.datacenter and b.datacenter:
        bandwidth = min(bandwidth, WAN_CAP)
    if a.region == b.region:
        distance = math.hypot(a.x_km - b.x_km, a.y_km - b.y_km)
        propagation = 2 * DETOUR * distance / FIBRE_KM_PER_S
    else:
        propagation = region_rtt(a.region, b.region)
    return bandwidth, a.access_rtt + b.access_rtt + propagation
