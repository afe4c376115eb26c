"""Logits computed through real peer processes match the whole model in one process."""

from __future__ import annotations

import torch

from peers.cli.launch import LocalSwarm
from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig, SwarmConfig
from peers.model import LocalModel


def _reference(model_dir, input_ids):
    logits, _ = LocalModel.from_dir(model_dir)(input_ids)
    return logits


def test_llama_logits_match_local_model(llama_client, llama_dir):
    torch.manual_seed(0)
    input_ids = torch.randint(0, 256, (3, 17))
    logits = llama_client.forward(input_ids)
    expected = _reference(llama_dir, input_ids)
    assert logits.shape == expected.shape == (3, 17, llama_client.model_config.vocab_size)
    assert (logits - expected).abs().max().item() < 1e-4


def test_chain_uses_both_peers(llama_client, llama_swarm):
    records = llama_client.records()
    assert sorted((r.start, r.end) for r in records) == [(0, 4), (4, 8)]
    assert {r.peer_id for r in records} == {p.peer_id for p in llama_swarm.processes[1:]}
    assert all(r.state.value == "online" and r.throughput > 0 for r in records)
    for record in records:  # each record names addresses that reach that very peer
        assert record.addresses and all(a.endswith(f"/p2p/{record.peer_id}") for a in record.addresses)


def test_partial_span_through_one_peer(llama_client, llama_dir):
    """A client may run any sub-span of a peer's blocks."""
    model = LocalModel.from_dir(llama_dir)
    hidden = torch.randn(2, 5, 64)
    positions = torch.arange(5).expand(2, 5)
    expected = hidden
    for block in model.blocks[5:7]:
        expected, _ = block(expected, positions)
    got = llama_client.run_blocks(hidden, 5, 7)
    assert (got - expected).abs().max().item() < 1e-4


def test_gpt2_logits_match_local_model(gpt2_dir, three_hop_swarm):
    """Through GPT-2 blocks 0:2, 2:4 and 4:6 on three peers."""
    with SwarmClient(gpt2_dir, initial_peers=three_hop_swarm.initial_peers) as client:
        input_ids = torch.randint(0, 256, (2, 11))
        logits = client.forward(input_ids)
    expected = _reference(gpt2_dir, input_ids)
    assert (logits - expected).abs().max().item() < 1e-4


def test_bfloat16_peers_and_client_match_the_local_model(llama_dir, tmp_path):
    """A bf16 swarm: hidden states travel as bf16 (2 bytes a value) and the logits match bf16 in one process."""
    with LocalSwarm(tmp_path, update_period=2.0) as swarm:
        swarm.start_dht()
        procs = [swarm.start_peer(llama_dir, block_indices=s, wait=False, extra=["--torch_dtype", "bfloat16"])
                 for s in ("0:4", "4:8")]
        for proc in procs:
            swarm.wait_ready(proc)
        config = ClientConfig(swarm=SwarmConfig(initial_peers=tuple(swarm.initial_peers)), torch_dtype="bfloat16")
        with SwarmClient(llama_dir, config=config) as client:
            assert {r.dtype for r in client.wait_for_records(2)} == {"bfloat16"}
            input_ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
            logits = client.forward(input_ids)
    expected, _ = LocalModel.from_dir(llama_dir, dtype=torch.bfloat16)(input_ids)
    assert logits.dtype == torch.bfloat16 and logits.shape == expected.shape
    assert torch.equal(logits, expected)
