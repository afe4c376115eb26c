"""The reachability check with real processes on 127.0.0.1: a peer that announces an address where nobody
listens cannot be dialled back; with relays off it refuses to start, saying what to do, and with relays on
(the default) it serves through the bootstrap peer as its relay, and clients get correct outputs from it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from peers.cli.launch import LocalSwarm
from peers.client.swarm_client import SwarmClient
from peers.model import LocalModel
from swarm.discovery import fetch_records

DEAD = "/ip4/127.0.0.1/tcp/9"  # the discard port: nobody listens there


@pytest.fixture(scope="module")
def dht_swarm(tmp_path_factory) -> Iterator[LocalSwarm]:
    """One bootstrap peer (the relay) for both tests: the refused peer exits before it announces anything."""
    with LocalSwarm(tmp_path_factory.mktemp("reachability")) as swarm:
        swarm.start_dht()
        yield swarm


def test_a_peer_nobody_can_dial_with_relays_off_is_refused_with_what_to_do(llama_dir, dht_swarm):
    proc = dht_swarm.start_peer(llama_dir, block_indices="0:8", wait=False,
                                extra=["--announce_maddrs", DEAD, "--no_relay"])
    assert proc.popen.wait(90) == 2, proc.log()
    log = proc.log()
    assert "this peer is not reachable" in log and "127.0.0.1:9" in log and "connection refused" in log
    assert "drop --no_relay" in log and "forward a TCP port" in log and "--force_reachability public" in log
    assert "Serving blocks" not in log


def test_a_peer_nobody_can_dial_serves_through_its_relay(llama_dir, dht_swarm):
    input_ids = torch.tensor([[3, 1, 4, 1, 5]])
    proc = dht_swarm.start_peer(llama_dir, block_indices="0:8", extra=["--announce_maddrs", DEAD])
    assert "serving through relay(s)" in proc.log(), proc.log()
    with SwarmClient(llama_dir, initial_peers=dht_swarm.initial_peers) as client:
        client.wait_for_records(1)
        (record,) = client._loop.run(fetch_records(client.node, client.model_name), timeout=30)
        tokens = client.generate(input_ids, 6)
    assert record.peer_id == proc.peer_id  # announced at its relay only
    assert record.addresses == (f"{dht_swarm.initial_peers[0]}/p2p-circuit/p2p/{proc.peer_id}",)
    assert tokens.tolist() == LocalModel.from_dir(llama_dir).generate_greedy(input_ids, 6).tolist()
