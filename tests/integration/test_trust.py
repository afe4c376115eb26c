"""A client chooses whom to trust: allowed_peers / blocked_peers decide who computes for it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from peers.cli.launch import LocalSwarm, SwarmProcess
from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig, SwarmConfig
from peers.model import LocalModel
from swarm.routing import MissingBlocksError


def _client(swarm, model_dir, **trust) -> SwarmClient:
    return SwarmClient(model_dir, config=ClientConfig(swarm=SwarmConfig(initial_peers=tuple(swarm.initial_peers)),
                                                      **trust))


@pytest.fixture(scope="module")
def two_peers(llama_dir, tmp_path_factory) -> Iterator[tuple[LocalSwarm, SwarmProcess, SwarmProcess]]:
    """Two peers that serve the whole model, shared by the module's tests (they kill none)."""
    with LocalSwarm(tmp_path_factory.mktemp("trust"), update_period=1.0) as swarm:
        swarm.start_dht()
        a, b = (swarm.start_peer(llama_dir, block_indices="0:8", wait=False) for _ in range(2))
        for proc in (a, b):
            swarm.wait_ready(proc)
        yield swarm, a, b


def test_only_trusted_peers_compute(two_peers, llama_dir):
    swarm, a, b = two_peers
    input_ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(9))
    expected = LocalModel.from_dir(llama_dir).generate_greedy(input_ids, 6).tolist()
    for trust, used, unused in (({"blocked_peers": (a.peer_id,)}, b, a), ({"allowed_peers": (a.peer_id,)}, a, b)):
        with _client(swarm, llama_dir, **trust) as client:
            client.wait_for_records(1)
            assert [r.peer_id for r in client.records()] == [used.peer_id]
            with _client(swarm, llama_dir) as observer:
                observer.wait_for_records(2)
                before = {p.peer_id: observer.info(p.peer_id).inference_steps for p in (a, b)}
                assert client.generate(input_ids, 6).tolist() == expected
                after = {p.peer_id: observer.info(p.peer_id).inference_steps for p in (a, b)}
            assert after[used.peer_id] > before[used.peer_id] and after[unused.peer_id] == before[unused.peer_id]


def test_no_trusted_peer_for_a_span_says_so(two_peers, llama_dir):
    swarm, a, b = two_peers
    with _client(swarm, llama_dir, blocked_peers=(a.peer_id, b.peer_id)) as client:
        with pytest.raises(MissingBlocksError, match="No online peer serves block"):
            client.forward(torch.tensor([[1, 2]]))


def test_a_peer_cannot_be_both_allowed_and_blocked():
    with pytest.raises(ValueError, match="both allowed and blocked"):
        ClientConfig(allowed_peers=("x",), blocked_peers=("x",))
