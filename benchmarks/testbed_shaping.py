"""How well the emulated WAN testbed's links hold their configured rates, as JSON.

    python benchmarks/testbed_shaping.py [--repeats 3] [--seconds 2] [--out results/testbed_shaping.json]

Root needed (network namespaces). First this machine's veth ceiling: TCP goodput between two hosts with no qdisc at
all (``unshaped``) and through an htb class at 100 Gbit/s (``htb``, what a shaped link carries here at most), and the
TCP round trip of one byte (no latency is emulated: no netem). Then,
for each named matrix (``lan`` on 2 hosts, ``three_sites`` on 6, ``home`` on 7 so that six 10 Mbit/s uploads exceed
one 50 Mbit/s download), one plain TCP transfer per distinct rate class (``swarm.testbed.rate_classes``); the whole
round (ceiling, then every matrix) repeated; medians. A class above the ceiling is compared with its round's ceiling
(``ratio_to_expected``). Rates count Ethernet frames, so TCP goodput tops out at ~1448/1514 = 0.956 of them at MTU 1500.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from rich.progress import Progress

from swarm.testbed import MATRICES, Testbed, rate_classes, require_root
from swarm.testbed.verify import measure_ceiling, verify

HOSTS = {"lan": 2, "three_sites": 6, "home": 7}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0, help="measured seconds per transfer")
    parser.add_argument("--warmup", type=float, default=0.5, help="seconds ignored at the start of a transfer")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    reason = require_root()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    total = args.repeats * (1 + sum(len(rate_classes(MATRICES[m], n)) for m, n in HOSTS.items()))
    ceilings: list[dict] = []
    runs: dict[str, list[list[dict]]] = {m: [] for m in HOSTS}
    with Progress(transient=True) as progress:
        task = progress.add_task("measuring", total=total)
        for _ in range(args.repeats):  # the ceiling a moment before each round: both are CPU-bound and noisy
            ceilings.append(measure_ceiling(args.seconds, args.warmup))
            progress.advance(task)
            for matrix, n in HOSTS.items():
                with Testbed(n, matrix) as tb:
                    runs[matrix].append(verify(tb, args.seconds, args.warmup, ceiling=ceilings[-1]["htb_bits_per_s"]))
                progress.advance(task, len(runs[matrix][-1]))
    result = {
        "seconds_per_transfer": args.seconds, "warmup": args.warmup, "repeats": args.repeats,
        "ceiling": {key: round(statistics.median(c[key] for c in ceilings), 0 if key.endswith("_per_s") else 4)
                    for key in ceilings[0]},
        "ceiling_runs": ceilings,
        "matrices": {matrix: [_median(classes) for classes in zip(*matrix_runs, strict=True)]
                     for matrix, matrix_runs in runs.items()},
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


def _median(repeats: tuple[dict, ...]) -> dict:
    """Medians over the rounds of one class (``ratio_to_expected``: of each round's own ratio to its ceiling)."""
    first = repeats[0]
    measured = [r["measured_bits_per_s"] for r in repeats]
    mid = statistics.median(measured)
    return {key: first[key] for key in ("kind", "senders", "receiver", "sites", "configured_bits_per_s")} | {
        "measured_bits_per_s": round(mid), "measured_runs": measured,
        "ratio": round(mid / first["configured_bits_per_s"], 4),
        "above_ceiling_runs": [r["above_ceiling"] for r in repeats],
        "ratio_to_expected": statistics.median(r["ratio_to_expected"] for r in repeats),
        "ratio_to_expected_runs": [r["ratio_to_expected"] for r in repeats],
    }


if __name__ == "__main__":
    sys.exit(main())
