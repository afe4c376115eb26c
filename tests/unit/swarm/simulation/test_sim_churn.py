"""Churn: Poisson joins at the given rate, exponential lifetimes with the mean the leave rate implies."""

from __future__ import annotations

import math
import random

import pytest

from swarm.simulation.churn import Churn, arrivals, lifetime


def test_joins_per_hour_is_the_mean_count():
    rng = random.Random(1)
    counts = [len(arrivals(rng, 600.0, 3600.0)) for _ in range(200)]
    mean = sum(counts) / len(counts)
    assert abs(mean - 600) < 4 * math.sqrt(600 / len(counts))  # 4 standard errors
    times = arrivals(random.Random(2), 600.0, 3600.0, start=100.0)
    assert times == sorted(times) and all(100.0 < t <= 3600.0 for t in times)


def test_leaves_per_hour_sets_the_mean_lifetime():
    churn = Churn(joins_per_hour=0, leaves_per_hour=500)
    mean = churn.mean_lifetime_s(1000)
    assert mean == pytest.approx(7200.0)
    rng = random.Random(3)
    lives = [lifetime(rng, mean) for _ in range(20_000)]
    assert sum(lives) / len(lives) == pytest.approx(mean, rel=0.03)
    gone = sum(life <= 3600.0 for life in lives[:1000])  # in the first hour: 1000 x (1 - e^-0.5) ~ 393
    assert abs(gone - 1000 * (1 - math.exp(-0.5))) < 4 * math.sqrt(1000 * 0.39 * 0.61)


def test_no_churn_means_no_events_and_bad_rates_are_refused():
    assert arrivals(random.Random(0), 0.0, 3600.0) == []
    assert math.isinf(lifetime(random.Random(0), Churn().mean_lifetime_s(10)))
    with pytest.raises(ValueError, match="joins_per_hour"):
        Churn(joins_per_hour=-1)
