"""What graph replicas average and which replica settings a run may name (``peers.server.graph_replicas``)."""

from __future__ import annotations

import pytest
import torch

from peers.server.graph_replicas import MAX_REPLICAS, check_replicas, flat_state, load_flat, numel
from peers.wire.errors import RequestError


def _stage() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Linear(4, 2))


def test_parameters_and_float_buffers_round_trip_and_batch_counters_stay():
    stage = _stage()
    stage.train()
    stage[1](torch.randn(2, 4, 5, 5))  # running statistics and the batch counter move
    flat = flat_state(stage)
    floats = [*stage.parameters(), stage[1].running_mean, stage[1].running_var]
    assert flat.numel() == numel(stage) == sum(t.numel() for t in floats)
    other = _stage()
    counter = other[1].num_batches_tracked.clone()
    load_flat(other, flat)
    assert all(torch.equal(a, b) for a, b in zip(floats, [*other.parameters(), other[1].running_mean,
                                                          other[1].running_var], strict=True))
    assert torch.equal(other[1].num_batches_tracked, counter)  # each replica's own
    load_flat(other, flat * 0 + 1)
    assert all(bool((p == 1).all()) for p in other.parameters())


def test_a_flat_tensor_of_another_size_is_refused():
    with pytest.raises(ValueError, match="values for a stage of"):
        load_flat(_stage(), torch.zeros(3))


@pytest.mark.parametrize("replicas, source, every, match", [
    (["b"] * (MAX_REPLICAS + 1), "", 1, "at most"),
    ([""], "", 1, "at most"),
    (["b"], "", 0, "average_every must be in"),
    (["b"], "c", 1, "must be another replica"),
    (["b"], "a", 1, "must be another replica"),
])
def test_bad_replica_settings_are_refused(replicas, source, every, match):
    with pytest.raises(RequestError, match=match):
        check_replicas(replicas, "a", source, every)


def test_good_replica_settings_pass():
    check_replicas([], "a", "", 1)
    check_replicas(["b", "c"], "a", "b", 4)
