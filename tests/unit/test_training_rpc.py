"""TrainingRPC.open: a replica joining a run under way counts from the run's step; a lone stage keeps its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from peers.model import load_blocks, make_tiny_model
from peers.protocol import RequestError, StageInfo, TrainOpen
from peers.training import OptimConfig
from peers.training_rpc import TrainingRPC

ME, OTHER = "12D3KooW" + "A" * 44, "12D3KooW" + "B" * 44


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("train-rpc") / "tiny", hidden_size=32, num_layers=2, num_heads=2,
                           num_kv_heads=1, intermediate_size=64)


def _rpc(model_dir: Path) -> TrainingRPC:
    info = StageInfo(peer_id=ME, model="tiny", start=0, end=2, hidden_size=32, dtype="float32", max_batch_size=8,
                     max_seq_len=64, max_request_bytes=1 << 20, throughput=1.0, version="test")
    return TrainingRPC(load_blocks(model_dir, 0, 2), info, stream_for=lambda peer: None)


def _open(run_step: int, replicas: list[str], run_id: str = "run") -> TrainOpen:
    return TrainOpen(run_id=run_id, start=0, end=2, optim=OptimConfig().to_dict(), accumulation=2,
                     replicas=replicas, run_step=run_step, explicit_apply=True)


def test_a_replica_joins_at_the_run_step_and_a_lone_stage_keeps_its_count(model_dir):
    stream = object()
    lone = _rpc(model_dir)
    assert lone.open(_open(7, []), stream) == 0  # alone: its weights are what it trained; a mismatch must show
    assert lone.open(_open(7, [ME]), stream) == 0
    joiner = _rpc(model_dir)
    assert joiner.open(_open(7, [ME, OTHER]), stream) == 7
    assert joiner.open(_open(3, [ME, OTHER]), stream) == 7  # never counts backwards
    assert joiner.open(_open(9, [OTHER, ME]), stream) == 9  # a re-opened run catches up too
    with pytest.raises(RequestError, match="run_step"):
        joiner.open(_open(-1, [ME, OTHER]), stream)
    joiner.shutdown()
    lone.shutdown()
