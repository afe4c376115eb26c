"""Real swarms on 127.0.0.1: a bootstrap peer and stage peers as separate processes, stopped by PID."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from peers.cli.launch import LocalSwarm
from peers.client.swarm_client import SwarmClient


@pytest.fixture(scope="session")
def llama_swarm(llama_dir, tmp_path_factory) -> Iterator[LocalSwarm]:
    """Blocks 0:4 and 4:8 of the tiny Llama on two peers, shared by the modules whose tests leave them as they were
    (each module has its own ``llama_client``)."""
    with LocalSwarm(tmp_path_factory.mktemp("llama_swarm"), update_period=2.0) as swarm:
        swarm.start_dht()
        procs = [
            swarm.start_peer(llama_dir, block_indices=span, wait=False, extra=["--max_request_bytes", "2000000"])
            for span in ("0:4", "4:8")
        ]
        for proc in procs:
            swarm.wait_ready(proc)
        yield swarm


@pytest.fixture(scope="session")
def three_hop_swarm(llama_dir, gpt2_dir, tmp_path_factory) -> Iterator[LocalSwarm]:
    """Three peers for each of the tiny Llama (0:3, 3:6, 6:8) and the tiny GPT-2 (0:2, 2:4, 4:6), shared by the
    modules whose tests leave them as they were (sessions closed, nothing trained, nobody killed)."""
    with LocalSwarm(tmp_path_factory.mktemp("three_hop_swarm"), update_period=2.0) as swarm:
        swarm.start_dht()
        procs = [swarm.start_peer(model_dir, block_indices=span, wait=False)
                 for model_dir, spans in ((llama_dir, ("0:3", "3:6", "6:8")), (gpt2_dir, ("0:2", "2:4", "4:6")))
                 for span in spans]
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

