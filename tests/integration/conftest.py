"""Real swarms on 127.0.0.1: a bootstrap peer and stage peers as separate processes, stopped by PID."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from peers.cli.launch import LocalSwarm
from peers.client.swarm_client import SwarmClient


@pytest.fixture(scope="module")
def llama_swarm(llama_dir, tmp_path_factory) -> Iterator[LocalSwarm]:
    """Blocks 0:4 and 4:8 of the tiny Llama on two peers."""
    with LocalSwarm(tmp_path_factory.mktemp("llama_swarm"), update_period=2.0) as swarm:
        swarm.start_dht()
        procs = [
            swarm.start_peer(llama_dir, block_indices=span, wait=False, extra=["--max_request_bytes", "2000000"])
            for span in ("0:4", "4:8")
        ]
        for proc in procs:
            swarm.wait_ready(proc)
        yield swarm


@pytest.fixture(scope="module")
def llama_client(llama_swarm, llama_dir) -> Iterator[SwarmClient]:
    client = SwarmClient(llama_dir, initial_peers=llama_swarm.initial_peers)
    client.wait_for_records(2)
    yield client
    client.close()


@pytest.fixture
def fresh_swarm(tmp_path) -> Iterator[LocalSwarm]:
    """An empty swarm (bootstrap peer only) for tests that kill or add peers; its peers allow its trainer."""
    with LocalSwarm(tmp_path, update_period=1.0, train=True) as swarm:
        swarm.start_dht()
        yield swarm

