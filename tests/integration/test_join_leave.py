"""Peers join and leave: a killed peer expires and its replica takes over; --num_blocks fills gaps."""

from __future__ import annotations

import os
import signal
import time

import torch

from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig, SwarmConfig
from peers.model import LocalModel


def _wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _client(swarm, model_dir) -> SwarmClient:
    config = ClientConfig(swarm=SwarmConfig(initial_peers=tuple(swarm.initial_peers)), request_timeout=10,
                          refresh_period=0.5)
    return SwarmClient(model_dir, config=config)


def test_killed_peer_expires_and_replica_serves(fresh_swarm, llama_dir):
    first = fresh_swarm.start_peer(llama_dir, block_indices="0:4", wait=False)
    doomed = fresh_swarm.start_peer(llama_dir, block_indices="4:8", wait=False)
    replica = fresh_swarm.start_peer(llama_dir, block_indices="4:8", wait=False)
    for proc in (first, doomed, replica):
        fresh_swarm.wait_ready(proc)
    input_ids = torch.randint(0, 256, (2, 9))
    expected, _ = LocalModel.from_dir(llama_dir)(input_ids)
    with _client(fresh_swarm, llama_dir) as client:
        _wait_until(lambda: len(client.records()) == 3, 15, "three records")
        assert (client.forward(input_ids) - expected).abs().max() < 1e-4

        doomed.kill(signal.SIGKILL)  # the peer and its p2p daemon die at once, announcing nothing
        assert (client.forward(input_ids) - expected).abs().max() < 1e-4  # re-routed to the replica
        _wait_until(lambda: doomed.peer_id not in {r.peer_id for r in client.records()}, 20, "the record to expire")
        assert {r.peer_id for r in client.records()} == {first.peer_id, replica.peer_id}
        assert (client.forward(input_ids) - expected).abs().max() < 1e-4


def test_num_blocks_fills_the_missing_blocks(fresh_swarm, llama_dir, swarm_cli):
    for proc in [fresh_swarm.start_peer(llama_dir, block_indices=span, wait=False) for span in ("0:2", "6:8")]:
        fresh_swarm.wait_ready(proc)
    status = swarm_cli("status", str(llama_dir), "--initial_peers", *fresh_swarm.initial_peers,
                       env={"COLUMNS": "200"})
    assert status.returncode == 0, status.stderr
    assert "missing blocks: 2:6" in status.stdout and "0:2" in status.stdout and "6:8" in status.stdout

    filler = fresh_swarm.start_peer(llama_dir, num_blocks=4)
    assert filler.blocks == (2, 6)
    input_ids = torch.randint(0, 256, (1, 6))
    expected, _ = LocalModel.from_dir(llama_dir)(input_ids)
    with _client(fresh_swarm, llama_dir) as client:
        _wait_until(lambda: len(client.records()) == 3, 15, "three records")
        assert (client.forward(input_ids) - expected).abs().max() < 1e-4


def test_sigterm_announces_offline_and_stops_the_daemon(fresh_swarm, llama_dir):
    peer = fresh_swarm.start_peer(llama_dir, block_indices="0:8")
    with _client(fresh_swarm, llama_dir) as client:
        _wait_until(lambda: client.records(), 15, "the record")
        os.kill(peer.pid, signal.SIGTERM)  # as `kill PID` or `docker stop` do: the peer, not its daemon
        assert peer.popen.wait(20) == 0
        records = client.records()
        assert all(r.state.value == "offline" for r in records if r.peer_id == peer.peer_id)
    assert "Stopped" in peer.log() and "Could not" not in peer.log()
    try:
        os.killpg(peer.pid, 0)  # any process left in the peer's group (e.g. its p2p daemon)?
        raise AssertionError("a process of the stopped peer is still running")
    except ProcessLookupError:
        pass
