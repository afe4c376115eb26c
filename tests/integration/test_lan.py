"""LAN discovery (mDNS, ``swarm.lan``) on 127.0.0.1: two peers that each start a swarm (``--new_swarm``, no
addresses) at the same time meet through mDNS, and a client with no addresses generates through both."""

from __future__ import annotations

import subprocess
import sys

from peers.cli.launch import LocalSwarm


def test_peers_and_client_find_each_other_with_no_addresses(llama_dir, tmp_path):
    with LocalSwarm(tmp_path, update_period=1.0, lan=True) as swarm:
        procs = [swarm.start_peer(llama_dir, block_indices=span, wait=False, extra=["--new_swarm"])
                 for span in ("0:4", "4:8")]
        for proc in procs:
            swarm.wait_ready(proc)
        assert all("Advertised on the LAN" in proc.log() for proc in procs)
        done = subprocess.run([sys.executable, "-m", "peers.cli", "generate", str(llama_dir), "--prompt", "hello",
                               "--max_new_tokens", "4"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.startswith("hello") and len(done.stdout.strip()) > len("hello"), done.stdout
        assert any("Met " in p.log() for p in procs), [p.log()[-2000:] for p in procs]  # one swarm now
