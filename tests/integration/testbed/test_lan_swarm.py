"""LAN discovery across hosts: 3 peers and a client on the testbed's bridge (each in its own network namespace),
none given an address; mDNS multicast on the bridge brings them into one swarm and the client generates."""

from __future__ import annotations

import subprocess
import sys

from peers.cli.launch import LocalSwarm, netns_prefix
from swarm.testbed import Testbed
from swarm.testbed.cleanup import leftovers, nothing_left

SPANS = ("0:3", "3:6", "6:8")


def test_three_peers_and_a_client_on_a_lan_with_no_addresses(llama_dir, tmp_path):
    with Testbed(4, None, workdir=tmp_path / "tb") as tb:
        prefix = tb.prefix
        hosts = tb.hosts
        with LocalSwarm(tmp_path / "swarm", update_period=2.0, lan=True) as swarm:
            swarm.start_peer(llama_dir, block_indices=SPANS[0], host=hosts[0], extra=["--new_swarm"])
            procs = [swarm.start_peer(llama_dir, block_indices=span, wait=False, host=host)
                     for span, host in zip(SPANS[1:], hosts[1:3], strict=True)]
            for proc in procs:
                swarm.wait_ready(proc)
                assert "Found" in proc.log(), proc.log()[-2000:]  # joined through an address heard on the bridge
            client = hosts[3]
            done = subprocess.run(
                [*netns_prefix(client.netns), sys.executable, "-m", "peers.cli", "generate", str(llama_dir),
                 "--prompt", "hello", "--max_new_tokens", "4", "--host_maddrs", f"/ip4/{client.address}/tcp/0"],
                capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr[-3000:]
            assert done.stdout.startswith("hello") and len(done.stdout.strip()) > len("hello"), done.stdout
    assert nothing_left(leftovers(prefix)), leftovers(prefix)
