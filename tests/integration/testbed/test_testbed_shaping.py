"""A plain TCP transfer between two hosts reaches 90-100% of the configured rate (75-100% for Gbit/s classes),
for every distinct rate class of each named matrix (both directions of ``home``: one upload, and six uploads into one
download)."""

from __future__ import annotations

import pytest

from swarm.testbed import Testbed
from swarm.testbed.verify import measure_ceiling, verify

HOSTS = {"lan": 2, "three_sites": 6, "home": 7}  # enough hosts to show every class (7: 6 x 10 > 50 Mbit/s)


@pytest.fixture(scope="module")
def ceiling() -> dict:
    """What the shaped veth path carries here at most (htb at 100 Gbit/s), and with no qdisc at all."""
    return measure_ceiling(seconds=1.5, warmup=0.5)


@pytest.mark.parametrize("matrix", sorted(HOSTS))
def test_every_rate_class_reaches_90_to_100_percent(matrix, ceiling):
    with Testbed(HOSTS[matrix], matrix) as tb:
        results = verify(tb, seconds=2.0, warmup=0.5, ceiling=ceiling["htb_bits_per_s"])
    assert len(results) == {"lan": 1, "three_sites": 3, "home": 2}[matrix]
    for r in results:
        if r["above_ceiling"]:
            # 2 shared cores cannot carry 10 Gbit/s (benchmarks/README.md: 3-7 Gbit/s, with the load of the hour):
            # how close it gets is a benchmark figure; the test checks the pair was not put in a slower class
            slower = max((c["configured_bits_per_s"] for c in results if not c["above_ceiling"]), default=None)
            floor = 10 * slower if slower is not None else 0.5 * r["expected_bits_per_s"]
            assert r["measured_bits_per_s"] >= floor, (r, ceiling)
        else:
            # a Gbit/s class is carried by the same 2 shared cores as everything else (it read 0.89 of 10 Gbit/s
            # under the suite's load): its floor is lower; a class shaped wrong is off by a factor of 10 or more
            low = 0.90 if r["configured_bits_per_s"] < 1e9 else 0.75
            assert low <= r["ratio"] <= 1.0, (r, ceiling)
