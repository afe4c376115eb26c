"""``python -m swarm.testbed``: make, check and clean up emulated WAN testbeds (root needed)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Sequence

from swarm.testbed.cleanup import cleanup_leftovers
from swarm.testbed.matrices import MATRICES, rate_classes
from swarm.testbed.testbed import Testbed, TestbedError

EPILOG = """\
Hosts are network namespaces on one Linux bridge (in a namespace of its own); links are shaped per ordered pair
and per host with htb. Rates count Ethernet frames, so TCP goodput is ~95% of them at MTU 1500.
No latency is emulated: this kernel has no netem, so every link adds ~0.1 ms at most.
Run a command in a host with `ip netns exec NETNS COMMAND` (NETNS as printed by `up`).
"""


def _fmt(bits: float | None) -> str:
    if bits is None:
        return "unshaped"
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g} {unit}"
    return f"{bits:g} bit/s"


def cmd_up(args: argparse.Namespace) -> int:
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with Testbed(args.hosts, args.matrix, prefix=args.prefix) as tb:
        for _ in range(args.nat):
            tb.add_nat_host()
        info = tb.describe()
        if args.json:
            print(json.dumps(info, indent=1), flush=True)
        else:
            print(f"testbed {info['prefix']} on {info['subnet']}, matrix {info['matrix']}: "
                  f"{info['matrix_description']}")
            for h in info["hosts"]:
                behind = f" (behind NAT router {h['router']}, seen as {h['public_address']})" if "router" in h else ""
                print(f"  {h['name']:<5} {h['address']:<15} {h['site']:<8} netns {h['netns']}{behind}")
            print("rates (row sends to column):")
            names = [h["name"] for h in info["hosts"]]
            print("  " + " " * 6 + "".join(f"{n:>14}" for n in names))
            for a in names:
                row = info["rates_bits_per_s"][a]
                print(f"  {a:<6}" + "".join(f"{'-' if a == b else _fmt(row[b]):>14}" for b in names))
            print("Ctrl-C (or SIGTERM) removes everything.", flush=True)
        stop.wait(args.seconds if args.seconds > 0 else None)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from swarm.testbed.verify import measure_ceiling, verify

    ceiling = measure_ceiling(args.seconds, args.warmup) if not args.no_ceiling else None
    with Testbed(args.hosts or _hosts_for(args.matrix), args.matrix) as tb:
        results = verify(tb, args.seconds, args.warmup, ceiling["htb_bits_per_s"] if ceiling else None)
    print(json.dumps({"matrix": args.matrix, "ceiling": ceiling, "classes": results}, indent=1))
    return 0


def _hosts_for(matrix: str) -> int:
    """Enough hosts to show every rate class: 3 sites of 2; 7 homes (6 uploads exceed one download)."""
    return {"three_sites": 6, "home": 7}.get(matrix, 2)


def cmd_cleanup(args: argparse.Namespace) -> int:
    report = cleanup_leftovers(force=args.force, prefix=args.prefix)
    print(json.dumps(report, indent=1) if report else "nothing to clean up")
    return 1 if any(r["action"] == "partly removed" for r in report) else 0


def cmd_matrices(args: argparse.Namespace) -> int:
    for name, matrix in MATRICES.items():
        n = args.hosts or _hosts_for(name)
        classes = ", ".join(f"{c['kind']} {_fmt(c['rate'])}" for c in rate_classes(matrix, n))
        print(f"{name:<12} {matrix.description}\n{'':<12} rate classes on {n} hosts: {classes}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m swarm.testbed", description=__doc__, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="make a testbed, print its hosts, addresses and rates, hold until Ctrl-C")
    up.add_argument("--hosts", type=int, default=6)
    up.add_argument("--matrix", default="three_sites", choices=sorted(MATRICES))
    up.add_argument("--nat", type=int, default=0, help="NAT hosts to add (each behind its own router)")
    up.add_argument("--prefix", default=None, help="namespace name prefix (default: a random tbXXXXXXXX)")
    up.add_argument("--seconds", type=float, default=0, help="hold this long instead of until Ctrl-C")
    up.add_argument("--json", action="store_true", help="print the description as JSON")
    up.set_defaults(func=cmd_up)
    ver = sub.add_parser("verify", help="JSON of configured vs measured TCP rates of each rate class of a matrix")
    ver.add_argument("--matrix", default="three_sites", choices=sorted(MATRICES))
    ver.add_argument("--hosts", type=int, default=0, help="default: enough to show every class")
    ver.add_argument("--seconds", type=float, default=2.0, help="measured seconds per class")
    ver.add_argument("--warmup", type=float, default=0.5, help="seconds ignored at the start of each transfer")
    ver.add_argument("--no_ceiling", action="store_true", help="skip measuring this machine's veth ceiling")
    ver.set_defaults(func=cmd_verify)
    cl = sub.add_parser("cleanup", help="remove what testbeds of dead processes left (by their state files)")
    cl.add_argument("--force", action="store_true", help="also testbeds whose owner still runs")
    cl.add_argument("--prefix", default=None, help="only this testbed")
    cl.set_defaults(func=cmd_cleanup)
    mat = sub.add_parser("matrices", help="the named matrices and their rate classes")
    mat.add_argument("--hosts", type=int, default=0)
    mat.set_defaults(func=cmd_matrices)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.func(args))
    except TestbedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
