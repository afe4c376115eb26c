"""Configured vs measured TCP rates of a testbed's rate classes, and the veth ceiling of this machine."""

from __future__ import annotations

from swarm.testbed.matrices import rate_classes
from swarm.testbed.shaping import UNSHAPED
from swarm.testbed.tcp_rate import measure
from swarm.testbed.testbed import Testbed


def verify(tb: Testbed, seconds: float = 2.0, warmup: float = 0.5, ceiling: float | None = None) -> list[dict]:
    """One TCP measurement per distinct rate class of ``tb``'s matrix (see ``rate_classes``).

    ``ratio`` is measured / configured. Where the configured rate is above ``ceiling`` (bits/s that the shaped veth
    path carries here at most, see ``measure_ceiling``), ``expected`` is the ceiling and ``above_ceiling`` is set:
    such a class cannot reach its configured rate on this machine.
    """
    results = []
    for cls in rate_classes(tb.matrix, tb.n):
        senders = [tb.hosts[i] for i in cls["senders"]]
        receiver = tb.hosts[cls["receiver"]]
        got = measure(tb, senders, receiver, seconds, warmup)
        configured = float(cls["rate"])
        above = ceiling is not None and configured > ceiling
        expected = min(configured, ceiling) if ceiling is not None else configured
        results.append({
            "matrix": tb.matrix.name, "kind": cls["kind"], "senders": [s.name for s in senders],
            "receiver": receiver.name, "sites": sorted({s.site for s in senders} | {receiver.site}),
            "configured_bits_per_s": configured, "measured_bits_per_s": round(got["bits_per_s"]),
            "ratio": round(got["bits_per_s"] / configured, 4), "above_ceiling": above,
            "expected_bits_per_s": expected, "ratio_to_expected": round(got["bits_per_s"] / expected, 4),
        })
    return results


def measure_ceiling(seconds: float = 2.0, warmup: float = 0.5) -> dict:
    """TCP goodput between two hosts of a fresh testbed: with no qdisc at all (``unshaped``), and through an htb
    class at 100 Gbit/s (``htb``: what a shaped link carries at most here, the htb path costs CPU too)."""
    with Testbed(2, matrix=None) as tb:
        unshaped = measure(tb, [tb.hosts[0]], tb.hosts[1], seconds, warmup)["bits_per_s"]
    with Testbed(2, matrix={(0, 1): UNSHAPED, (1, 0): UNSHAPED}) as tb:
        htb = measure(tb, [tb.hosts[0]], tb.hosts[1], seconds, warmup)["bits_per_s"]
    return {"unshaped_bits_per_s": round(unshaped), "htb_bits_per_s": round(htb)}
