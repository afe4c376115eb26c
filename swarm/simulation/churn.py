"""Churn: peers join as a Poisson process and each stays for an exponentially distributed lifetime.

Rates are given per hour: ``joins_per_hour`` new peers, and ``leaves_per_hour`` departures at the starting
population (each peer's mean lifetime is ``population / leaves_per_hour``, so the population drifts towards
``joins_per_hour x mean lifetime``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Churn:
    joins_per_hour: float = 0.0
    leaves_per_hour: float = 0.0

    def __post_init__(self) -> None:
        for name in ("joins_per_hour", "leaves_per_hour"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"Churn.{name} must be a finite number >= 0, got {value!r}")

    def mean_lifetime_s(self, population: int) -> float:
        """A peer's mean lifetime in seconds (infinite without departures)."""
        return math.inf if self.leaves_per_hour == 0 else 3600.0 * max(population, 1) / self.leaves_per_hour


def lifetime(rng: random.Random, mean_s: float) -> float:
    """An exponential lifetime (infinite when ``mean_s`` is)."""
    return math.inf if math.isinf(mean_s) else rng.expovariate(1.0 / mean_s)


def arrivals(rng: random.Random, per_hour: float, until: float, start: float = 0.0) -> list[float]:
    """The times of a Poisson process of ``per_hour`` events in ``(start, until]``."""
    if per_hour <= 0:
        return []
    times, t = [], start
    while True:
        t += rng.expovariate(per_hour / 3600.0)
        if t > until:
            return times
        times.append(t)
