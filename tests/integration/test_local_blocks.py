"""--local_blocks N: the client runs the first N blocks itself; peers only ever see later activations."""

from __future__ import annotations

import pytest
import torch

from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig, SwarmConfig
from peers.model import LocalModel
from swarm.routing import MissingBlocksError


def _client(swarm, model_dir, local_blocks: int) -> SwarmClient:
    config = ClientConfig(swarm=SwarmConfig(initial_peers=tuple(swarm.initial_peers)), local_blocks=local_blocks)
    return SwarmClient(model_dir, config=config)


def test_first_blocks_run_on_the_client(fresh_swarm, llama_dir):
    fresh_swarm.start_peer(llama_dir, block_indices="2:8")  # nobody in the swarm serves blocks 0:2
    model = LocalModel.from_dir(llama_dir)
    input_ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(4))
    with _client(fresh_swarm, llama_dir, local_blocks=2) as client:
        client.wait_for_records(1)
        expected, _ = model(input_ids)
        assert (client.forward(input_ids) - expected).abs().max() < 1e-4
        assert client.generate(input_ids, 12).tolist() == model.generate_greedy(input_ids, 12).tolist()
    with _client(fresh_swarm, llama_dir, local_blocks=0) as client:  # control: the swarm alone lacks 0:2
        client.wait_for_records(1)
        with pytest.raises(MissingBlocksError, match="block\\(s\\) 0, 1"):
            client.forward(input_ids)
