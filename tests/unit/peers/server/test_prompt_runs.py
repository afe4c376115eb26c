"""PromptRuns: prompt runs of several streams side by side on one peer's blocks, bounded, ended with their stream."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from peers.model import load_blocks, make_tiny_model
from peers.server.prompt_runs import PromptRuns
from peers.training import OptimConfig
from peers.training.prompts import pack
from peers.wire.errors import RequestError
from peers.wire.messages import TrainOpen

H, P = 32, 2


@pytest.fixture(scope="module")
def blocks(tmp_path_factory: pytest.TempPathFactory):
    model = make_tiny_model(tmp_path_factory.mktemp("prompt-runs") / "tiny", hidden_size=H, num_layers=2,
                            num_heads=4, num_kv_heads=2, intermediate_size=64, seed=4)
    return load_blocks(Path(model), 0, 2)


def _open(run_id: str, **overrides) -> TrainOpen:
    return TrainOpen(**{"run_id": run_id, "start": 0, "end": 2, "optim": OptimConfig().to_dict(), "accumulation": 1,
                        "prompts": P, "deep_prompts": True, "explicit_apply": True, **overrides})


def test_runs_side_by_side_bounded_and_ended_with_their_stream(blocks) -> None:
    runs = PromptRuns(blocks, max_pending=4, limit=2)
    first, second = object(), object()
    assert runs.open(_open("a"), first) == 0
    assert runs.open(_open("a", run_step=5), second) == 5  # another trainer's run of the same name: its own
    with pytest.raises(RequestError, match="2 prompt-tuning runs already"):
        runs.open(_open("b"), first)
    with pytest.raises(RequestError, match="star topology only"):
        runs.open(_open("a", downstream=["peer"]), first)
    with pytest.raises(RequestError, match="staleness = 0"):
        runs.open(_open("a", staleness=1), first)
    run = runs.get("a", first)
    assert run is not None and runs.get("a", second) is not run
    hidden = torch.randn(1, 6, H)
    run.forward_packed("m", pack(hidden, torch.zeros(2, P, H)), [2, P, H])
    assert runs.open(_open("a"), first) == 0 and run.pending == 0  # a re-open discards the partial step
    runs.discard("a", second)
    assert runs.get("a", second) is None and runs.open(_open("a"), second) == 0
    runs.closed(first)
    assert runs.get("a", first) is None and runs.get("a", second) is not None
    assert runs.open(_open("b"), first) == 0  # room again
