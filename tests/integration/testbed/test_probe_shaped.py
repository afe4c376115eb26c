"""A joining peer's probes on shaped links: its record's bandwidths follow the testbed's rates (issue 11 part 2).

Hosts: h0 bootstrap, h1 peer 0:4, h2 peer 4:8, h3 the joiner 0:8; h3 <-> h1 is shaped to 50 Mbit/s, h3 <-> h2 to
8 Mbit/s (no latency: this kernel has no netem). On 8 Mbit/s the probe's first transfer (1 MiB, ~1 s) is its
reading: 94-98% of the wire rate (TCP goodput is ~95%). On 50 Mbit/s 1 MiB lasts ~170 ms, where fixed costs and a
loaded CPU weighed (56-91% seen when it was the reading), so a 4 MiB transfer follows (``peers.wire.probe``) and reads
84-95% (seen at load averages 2-15 on 2 cores). Both are held to 0.7x-1.05x of the shaped rate.
"""

from __future__ import annotations

import json
import sys

from peers.cli.launch import LocalSwarm
from swarm.testbed import Testbed

RATES = {(3, 1): 50e6, (1, 3): 50e6, (3, 2): 8e6, (2, 3): 8e6}
READER = """
import json, sys, time
from peers.client.swarm_client import SwarmClient
model, joiner, peers = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
with SwarmClient(model, initial_peers=peers) as client:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        rec = next((r for r in client.records() if r.peer_id == joiner), None)
        if rec is not None and len(rec.links) >= 2:
            break
        time.sleep(0.5)
    print("rows " + json.dumps([row.to_wire() for row in (rec.links if rec else ())]))
"""


def test_a_joiners_probes_read_the_shaped_rates(llama_dir, tmp_path):
    with Testbed(4, RATES, workdir=tmp_path / "tb") as tb:
        h = {host.name: host for host in tb.hosts}
        with LocalSwarm(tmp_path / "swarm", update_period=2.0) as swarm:
            swarm.probe_max_mib = None  # the peers' own cap (16 MiB): the 50 Mbit/s link needs a 4 MiB transfer
            swarm.start_dht(host=h["h0"])
            started = [swarm.start_peer(llama_dir, block_indices=span, host=h[name], name=name, wait=False)
                       for name, span in (("h1", "0:4"), ("h2", "4:8"))]
            fast, slow = (swarm.wait_ready(proc)[2] for proc in started)  # both up before the joiner starts
            joiner = swarm.start_peer(llama_dir, block_indices="0:8", host=h["h3"], name="joiner")
            (tmp_path / "reader.py").write_text(READER)
            out = tb.run(h["h3"], [sys.executable, str(tmp_path / "reader.py"), str(llama_dir), joiner.peer_id,
                                   json.dumps(swarm.initial_peers)], timeout=120).stdout
    rows = json.loads(next(line for line in out.splitlines() if line.startswith("rows "))[5:])
    by_peer = {row["peer"]: row for row in rows}
    assert {fast, slow} <= by_peer.keys(), f"the joiner's record lacks its links: {rows}"
    assert all(by_peer[p]["src"] == "probe" and by_peer[p]["rtt"] > 0 for p in (fast, slow))
    slow_bw, fast_bw = by_peer[slow]["bw"], by_peer[fast]["bw"]
    print(f"probe readings: 8 Mbit/s link {slow_bw / 1e6:.2f} Mbit/s, 50 Mbit/s link {fast_bw / 1e6:.2f} Mbit/s")
    assert 0.7 * 8e6 <= slow_bw <= 1.05 * 8e6, f"8 Mbit/s link read {slow_bw / 1e6:.2f} Mbit/s"
    assert 0.7 * 50e6 <= fast_bw <= 1.05 * 50e6, f"50 Mbit/s link read {fast_bw / 1e6:.2f} Mbit/s"
