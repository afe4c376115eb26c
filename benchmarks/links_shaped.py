"""What a joining peer's probes read on shaped links, as JSON (root, and the testbed of issue 11 part 1).

    python benchmarks/links_shaped.py [--runs 2] [--workdir DIR]

4 hosts of ``swarm.testbed``: a bootstrap peer (h0), peers 0:4 (h1) and 4:8 (h2) of a tiny Llama, then a joiner 0:8
(h3) whose links to h1 are shaped to 50 Mbit/s and to h2 to 8 Mbit/s (both directions; no added latency: this
kernel has no netem). The joiner probes both at once (a warm-up, 3 round trips, one 1 MiB transfer); each run
reports what its record says against the shaped rate.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from rich.progress import Progress

from peers.cli.launch import LocalSwarm
from peers.model import make_tiny_model

try:
    from swarm.testbed import Testbed  # type: ignore[import-not-found, unused-ignore]
except ImportError:  # the testbed is another branch of issue 11 until it is merged
    Testbed = None

TINY = dict(family="llama", hidden_size=64, num_layers=8, num_heads=4, num_kv_heads=2, intermediate_size=128)
RATES = {(3, 1): 50e6, (1, 3): 50e6, (3, 2): 8e6, (2, 3): 8e6}


def one_run(workdir: Path, model: Path) -> list[dict]:
    with Testbed(4, RATES, workdir=workdir / "tb") as tb:
        h = {host.name: host for host in tb.hosts}
        with LocalSwarm(workdir / "swarm", update_period=2.0) as swarm:
            swarm.start_dht(host=h["h0"])
            shaped = {swarm.start_peer(model, block_indices="0:4", host=h["h1"], name="h1").peer_id: 50e6,
                      swarm.start_peer(model, block_indices="4:8", host=h["h2"], name="h2").peer_id: 8e6}
            joiner = swarm.start_peer(model, block_indices="0:8", host=h["h3"], name="joiner")
            rows = _joiner_rows(tb, h["h3"], swarm, model, joiner.peer_id, workdir)
    return [{"rate_mbit_s": shaped[row["peer"]] / 1e6, "probed_mbit_s": row["bw"] / 1e6,
             "ratio": row["bw"] / shaped[row["peer"]], "rtt_ms": row["rtt"] * 1e3} for row in rows
            if row["peer"] in shaped]


def _joiner_rows(tb, host, swarm, model: Path, joiner: str, workdir: Path) -> list[dict]:
    """The joiner's link rows, read by a client inside the testbed (the root namespace cannot reach the hosts)."""
    script = workdir / "read_links.py"
    script.write_text(f"""
import json, time
with SwarmClient({str(model)!r}, initial_peers={swarm.initial_peers!r}) as client:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        rec = next((r for r in client.records() if r.peer_id == {joiner!r}), None)
        if rec is not None and len(rec.links) >= 2:
            break
        time.sleep(0.5)
    print("rows " + json.dumps([row.to_wire() for row in (rec.links if rec else ())]))
""")
    out = tb.run(host, [sys.executable, str(script)], timeout=120).stdout
    out = out if isinstance(out, str) else out.decode()
    return json.loads(next(line for line in out.splitlines() if line.startswith("rows "))[5:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    if Testbed is None:
        sys.exit("links_shaped.py needs swarm.testbed (issue 11 part 1): run it on a tree that has the testbed")
    with tempfile.TemporaryDirectory(prefix="fusionswarm-links-shaped-") as tmp, Progress() as progress:
        workdir = args.workdir or Path(tmp)
        model = make_tiny_model(workdir / "tiny", seed=1, **TINY)
        task = progress.add_task("shaped probe runs", total=args.runs)
        runs = []
        for i in range(args.runs):
            started = time.monotonic()
            runs.append({"links": one_run(workdir / f"run{i}", model), "seconds": time.monotonic() - started})
            progress.advance(task)
    print(json.dumps({"runs": runs}, indent=1))


if __name__ == "__main__":
    main()
