"""A part saved with its buffers (a graph stage's BatchNorm statistics, issue 18) loads them back exactly, and a
checkpoint whose buffers do not fit (another graph or node range) is refused before anything changes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from peers.training.state import load_stage_state, save_stage_state


def _part(channels: int = 4) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, channels, 3), nn.BatchNorm2d(channels))


def test_buffers_round_trip_and_a_misfit_changes_nothing(tmp_path):
    part = _part()
    optimizer = torch.optim.AdamW(part.parameters())
    part.train()
    part(torch.randn(2, 3, 8, 8)).sum().backward()  # running statistics move, gradients for a step
    optimizer.step()
    save_stage_state(tmp_path / "s", part, optimizer, 1, {"kind": "graph"}, buffers=True)

    fresh = _part()
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    info = load_stage_state(tmp_path / "s", fresh, fresh_opt, expect={"kind": "graph"}, buffers=True)
    assert info["step"] == 1
    for (name, a), b in zip(part.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # weights and running_mean/var/num_batches_tracked

    other = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=False))  # no running stats
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match="buffers at .* do not fit this part"):
        load_stage_state(tmp_path / "s", other, torch.optim.AdamW(other.parameters()), buffers=True)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    save_stage_state(tmp_path / "t", part, optimizer, 1, {}, buffers=False)
    with pytest.raises(ValueError, match="saved without the module's buffers"):
        load_stage_state(tmp_path / "t", fresh, fresh_opt, buffers=True)
