"""Fuzz tests of every parser that takes bytes from the network: a bounded, reproducible hypothesis profile."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

# 200 examples per test, the same ones on every run (CI failures reproduce); all fuzz tests: well under a minute
settings.register_profile("fuzz", max_examples=200, deadline=None, derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("fuzz")
