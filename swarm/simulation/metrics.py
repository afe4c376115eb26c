"""What a simulation measures: achieved throughput over time against the bound, recoveries, moves, planner time.

Achieved throughput is piecewise constant (it changes only at events): ``Metrics.rate`` records each change and
integrates it, so a bucket's value is the time-weighted mean over the bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def quantile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (nearest rank) of ``values``; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass
class Recovery:
    """A group (of ``lost`` tokens/s) broken by a departure at ``start``; ``end`` when it works again; ``how``:
    "backup" (a backup took the leaver's span), "replan" (a re-plan dissolved the group: it ends when the re-plan's
    new groups that work make up ``lost``, or all of them work), "dissolved" (a re-plan dissolved it and made no new
    group: nothing to wait for, the capacity is lost) or "" while open."""

    start: float
    lost: float = 0.0
    end: float | None = None
    how: str = ""

    @property
    def seconds(self) -> float | None:
        return None if self.end is None else self.end - self.start


@dataclass
class Metrics:
    bucket_s: float = 60.0
    now: float = 0.0
    achieved: float = 0.0  # tokens/s of the working groups, now
    bound: float = 0.0  # the latest candidate plan's tokens/s for the population of its time
    _area: dict[int, float] = field(default_factory=dict)  # bucket -> integral of achieved over it
    bounds: dict[int, float] = field(default_factory=dict)  # bucket -> the bound at its end
    population: dict[int, int] = field(default_factory=dict)
    recoveries: list[Recovery] = field(default_factory=list)
    moves: int = 0  # peers given a new span (a re-plan's changes and backups taking over)
    takeovers: int = 0  # of which backups taking a leaver's span
    plans_adopted: int = 0
    plan_seconds: list[float] = field(default_factory=list)  # wall seconds of each make_plan call
    plan_sizes: list[int] = field(default_factory=list)  # peers given to each make_plan call

    def rate(self, now: float, achieved: float) -> None:
        """The achieved tokens/s changes to ``achieved`` at ``now``."""
        self.advance(now)
        self.achieved = achieved

    def advance(self, now: float) -> None:
        if now < self.now:
            raise ValueError(f"metrics went back in time: {now} < {self.now}")
        t = self.now
        while t < now:
            bucket = int(t // self.bucket_s)
            end = min(now, (bucket + 1) * self.bucket_s)
            self._area[bucket] = self._area.get(bucket, 0.0) + self.achieved * (end - t)
            self.bounds[bucket] = self.bound
            t = end
        self.now = now

    def set_bound(self, now: float, bound: float, population: int) -> None:
        self.advance(now)
        self.bound = bound
        self.bounds[int(now // self.bucket_s)] = bound
        self.population[int(now // self.bucket_s)] = population

    def series(self) -> list[dict[str, float]]:
        """Per bucket: its start (s), the mean achieved tokens/s, the bound at its end, their ratio."""
        rows = []
        for bucket in sorted(self._area):
            start = bucket * self.bucket_s
            width = min(self.bucket_s, self.now - start)
            if width <= 0:
                continue
            mean = self._area[bucket] / width
            bound = self.bounds.get(bucket, 0.0)
            rows.append({"t_s": start, "achieved": mean, "bound": bound,
                         "ratio": mean / bound if bound > 0 else 0.0})
        return rows

    def mean_achieved(self) -> float:
        return sum(self._area.values()) / self.now if self.now > 0 else 0.0

    def summary(self) -> dict[str, object]:
        done = [r.seconds for r in self.recoveries if r.seconds is not None and r.how != "dissolved"]
        by_backup = [r.seconds for r in self.recoveries if r.seconds is not None and r.how == "backup"]
        dissolved = sum(r.how == "dissolved" for r in self.recoveries)
        hours = self.now / 3600 if self.now > 0 else math.nan
        rows = self.series()
        bound_mean = sum(r["bound"] for r in rows) / len(rows) if rows else 0.0
        return {
            "simulated_s": self.now,
            "achieved_mean_tokens_per_s": self.mean_achieved(),
            "bound_mean_tokens_per_s": bound_mean,
            "achieved_over_bound": self.mean_achieved() / bound_mean if bound_mean > 0 else None,
            "departures_breaking_a_group": len(self.recoveries), "recoveries": len(done),
            "recoveries_open": len(self.recoveries) - len(done) - dissolved, "groups_dissolved": dissolved,
            "recoveries_by_backup": len(by_backup), "recoveries_by_replan": len(done) - len(by_backup),
            "recovery_median_s": quantile(done, 0.5), "recovery_p90_s": quantile(done, 0.9),
            "recovery_by_backup_median_s": quantile(by_backup, 0.5),
            "moves_per_hour": self.moves / hours, "takeovers_per_hour": self.takeovers / hours,
            "plans_adopted": self.plans_adopted,
            "replans": len(self.plan_seconds), "plan_s_median": quantile(self.plan_seconds, 0.5),
            "plan_s_max": max(self.plan_seconds, default=None),
        }
