"""measure_block: forward and backward seconds per token of one block, leaving the served weights as they were."""

from __future__ import annotations

import torch

from peers.model import load_blocks
from peers.server.block_timing import measure_block


def test_measure_block_times_forward_and_backward_and_leaves_the_weights_frozen(llama_dir):
    blocks = load_blocks(llama_dir, 0, 1, device=torch.device("cpu"), dtype=torch.float32)
    before = [p.detach().clone() for p in blocks[0].parameters()]
    compute = measure_block(blocks[0], 64, torch.device("cpu"), torch.float32, tokens=16)
    assert compute.forward > 0 and compute.backward > 0
    for p, old in zip(blocks[0].parameters(), before, strict=True):
        assert not p.requires_grad and p.grad is None and torch.equal(p, old)
