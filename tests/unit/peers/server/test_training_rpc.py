"""TrainingRPC.open: a replica joining a run under way counts from the run's step; a lone stage keeps its own.
Checkpoints never overwrite a newer step; a step that would make weights non-finite is rolled back."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch

from peers.core.trainers import TrainerPolicy
from peers.model import load_blocks, make_tiny_model
from peers.server.training_rpc import TrainingRPC
from peers.training import GradientError, OptimConfig, StageTrainer
from peers.training.state import read_state_info
from peers.wire.errors import RequestError
from peers.wire.messages import ParamsFetch, StageInfo, TrainOpen

ME, OTHER = "12D3KooW" + "A" * 44, "12D3KooW" + "B" * 44


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("train-rpc") / "tiny", hidden_size=32, num_layers=2, num_heads=2,
                           num_kv_heads=1, intermediate_size=64)


def _rpc(model_dir: Path) -> TrainingRPC:
    info = StageInfo(peer_id=ME, model="tiny", start=0, end=2, hidden_size=32, dtype="float32", max_batch_size=8,
                     max_seq_len=64, max_request_bytes=1 << 20, throughput=1.0, version="test")
    return TrainingRPC(load_blocks(model_dir, 0, 2), info, trainers=TrainerPolicy(("anyone",)),
                       stream_for=lambda peer: None)


def _open(run_step: int, replicas: list[str], run_id: str = "run") -> TrainOpen:
    return TrainOpen(run_id=run_id, start=0, end=2, optim=OptimConfig().to_dict(), accumulation=2,
                     replicas=replicas, run_step=run_step, explicit_apply=True)


def _run(rpc: TrainingRPC, request: TrainOpen, stream: object) -> int:
    return asyncio.run(rpc.open(request, stream))


def test_a_replica_joins_at_the_run_step_and_a_lone_stage_keeps_its_count(model_dir):
    stream = object()
    lone = _rpc(model_dir)
    assert _run(lone, _open(7, []), stream) == 0  # alone: its weights are what it trained; a mismatch must show
    assert _run(lone, _open(7, [ME]), stream) == 0
    joiner = _rpc(model_dir)  # its replica OTHER cannot be reached here: it keeps its weights, counts from 7
    assert _run(joiner, _open(7, [ME, OTHER]), stream) == 7
    assert _run(joiner, _open(3, [ME, OTHER]), stream) == 7  # never counts backwards
    assert _run(joiner, _open(9, [OTHER, ME]), stream) == 9  # a re-opened run catches up too
    with pytest.raises(RequestError, match="run_step"):
        _run(joiner, _open(-1, [ME, OTHER]), stream)
    with pytest.raises(RequestError, match="average_every"):
        _run(joiner, dataclasses.replace(_open(9, [ME, OTHER]), average_every=-2), stream)
    joiner.shutdown()
    lone.shutdown()


def test_finding_12_a_checkpoint_never_overwrites_a_newer_step_of_the_run(model_dir, tmp_path, caplog):
    """A peer whose blocks are behind their own checkpoint of the run (say its load failed) trains on, but its saves
    keep the newer checkpoint instead of overwriting it with an older step."""
    stream, path = object(), tmp_path / "run" / "blocks-0-2"
    ahead = _rpc(model_dir)
    ahead.checkpoint_dir = tmp_path
    _run(ahead, _open(0, []), stream)
    ahead.trainer.part.step_count = 80
    assert ahead.save_unsaved() == path and read_state_info(path)["step"] == 80
    behind = _rpc(model_dir)
    behind.checkpoint_dir = tmp_path
    behind.trainer = StageTrainer(behind.blocks, OptimConfig(), 1, auto_step=False)  # a run open at step 0
    behind.run_id, behind.owner, behind.checkpoint_every = "run", stream, 1
    behind.trainer.part.step_count = 5
    assert behind.save_unsaved() is None
    asyncio.run(behind._after_step(behind.trainer))  # a step's checkpoint: refused the same way
    assert read_state_info(path)["step"] == 80
    assert "step 5 of blocks 0:2 not saved" in caplog.text and "holds step 80 of this run, newer" in caplog.text
    ahead.shutdown()
    behind.shutdown()


def test_finding_01_a_step_that_would_make_weights_non_finite_is_rolled_back(model_dir):
    """Defence in depth against an allowed but buggy trainer: the step is refused, weights and AdamW state stay."""
    blocks = load_blocks(model_dir, 0, 2)
    trainer = StageTrainer(blocks, OptimConfig(lr=1e-2), 1, auto_step=False)
    hidden, positions = torch.randn(1, 4, 32), torch.arange(4)[None]
    trainer.backward("a", torch.ones(1, 4, 32), hidden=hidden, position_ids=positions)
    trainer.apply(1)  # one good step: AdamW state exists
    before = [p.detach().clone() for p in blocks.parameters()]
    moments = [trainer.part.optimizer.state[p]["exp_avg"].clone() for p in blocks.parameters()]
    step = trainer.part.optimizer.step

    def poisoned_step(*args, **kwargs):  # a step whose result overflows, as a wild update would
        step(*args, **kwargs)
        next(blocks.parameters()).data[0] = float("inf")

    trainer.part.optimizer.step = poisoned_step
    trainer.backward("b", torch.ones(1, 4, 32), hidden=hidden, position_ids=positions)
    with pytest.raises(GradientError, match=r"NaN or infinite; it was rolled back"):
        trainer.apply(1)
    assert trainer.step == 1 and trainer.micro_count == 0
    assert all(torch.equal(a, b) for a, b in zip(before, blocks.parameters(), strict=True))
    assert all(torch.equal(m, trainer.part.optimizer.state[p]["exp_avg"])
               for m, p in zip(moments, blocks.parameters(), strict=True))
    trainer.part.optimizer.step = step
    trainer.backward("c", torch.ones(1, 4, 32), hidden=hidden, position_ids=positions)
    trainer.apply(1)  # the next good step applies
    assert trainer.step == 2


def test_a_params_fetch_naming_a_run_gets_only_that_runs_weights(model_dir):
    rpc = _rpc(model_dir)
    with pytest.raises(RequestError, match="hold no training run's weights"):
        rpc.current_params(ParamsFetch(start=0, end=1, run_id="run"))
    assert rpc.current_params(ParamsFetch(start=0, end=1)).numel() > 0  # no run named: whatever it serves
    _run(rpc, _open(0, []), object())
    with pytest.raises(RequestError, match="hold run 'run'.s weights, not run 'other'.s"):
        rpc.current_params(ParamsFetch(start=0, end=2, run_id="other"))
    flat = rpc.current_params(ParamsFetch(start=1, end=2, run_id="run"))
    assert torch.equal(flat, torch.nn.utils.parameters_to_vector(rpc.blocks[1].parameters()))
    rpc.shutdown()
