"""Adapter runs on a peer (issue 19): who may open them (``--adapters``), that a run's adapters are its trainer's,
that bad adapter input is refused with a clear error and changes nothing, and loaded adapters for inference."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from peers.core.config import StageServerConfig, SwarmConfig
from peers.core.trainers import TrainerPolicy
from peers.model import load_blocks, make_tiny_model
from peers.server.adapter_runs import AdapterRuns
from peers.server.training_rpc import TrainingRPC
from peers.training import OptimConfig
from peers.training.lora import LoraAdapter, parse_adapter
from peers.wire.errors import RequestError
from peers.wire.messages import AdapterLoad, ParamsFetch, StageInfo, TrainOpen, TrainPush

ME, OTHER = "12D3KooW" + "A" * 44, "12D3KooW" + "B" * 44
SPEC = "lora:r=2,alpha=4,targets=q_proj+v_proj"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("adapter-runs") / "tiny", hidden_size=32, num_layers=2,
                           num_heads=2, num_kv_heads=1, intermediate_size=64)


def _runs(model_dir: Path, policy: TrainerPolicy, checkpoint_dir: Path | None = None) -> AdapterRuns:
    blocks = load_blocks(model_dir, 0, 2)
    info = StageInfo(peer_id="12D3KooW" + "C" * 44, model="tiny", start=0, end=2, hidden_size=32, dtype="float32",
                     max_batch_size=8, max_seq_len=64, max_request_bytes=1 << 20, throughput=1.0, version="test")

    def make() -> TrainingRPC:
        return TrainingRPC(blocks, info, trainers=TrainerPolicy(), stream_for=lambda peer: None, adapter_mode=True,
                           checkpoint_dir=checkpoint_dir)

    return AdapterRuns(make, policy, blocks)


def _open(adapter: str = SPEC, **kw) -> TrainOpen:
    return TrainOpen(run_id="mine", start=0, end=2, optim=OptimConfig().to_dict(), accumulation=1, adapter=adapter,
                     **kw)


def test_adapters_flag_defaults_to_anyone_and_none_turns_them_off(model_dir: Path) -> None:
    swarm = SwarmConfig(new_swarm=True)
    assert StageServerConfig(model_dir=model_dir, swarm=swarm, num_blocks=1).adapter_policy().anyone
    assert not StageServerConfig(model_dir=model_dir, swarm=swarm, num_blocks=1, adapters="none").adapter_policy() \
        .enabled
    with pytest.raises(ValueError, match="--adapters members"):
        StageServerConfig(model_dir=model_dir, swarm=swarm, num_blocks=1, adapters="members")
    off = _runs(model_dir, TrainerPolicy())
    assert "--adapters none" in off.refusal(_open(), ME)


def test_a_run_is_its_trainers_and_bad_input_changes_nothing(model_dir: Path) -> None:
    runs = _runs(model_dir, TrainerPolicy(("anyone",)))
    stream = object()
    for bad, says in [("lora:r=2,targets=c_attn", "do not exist in this llama model"), ("lora:r=99,targets=q_proj",
                      "exceeds the size"), ("lora:r=2,targets=nope", "unknown target")]:
        with pytest.raises(RequestError, match=says):
            asyncio.run(runs.open(_open(bad), stream, ME))
        assert runs.get("mine") is None
    with pytest.raises(RequestError, match="one peer per span"):
        asyncio.run(runs.open(_open(average_every=2, replicas=[OTHER]), stream, ME))
    assert asyncio.run(runs.open(_open(), stream, ME)) == 0
    with pytest.raises(RequestError, match="trains the adapter"):
        asyncio.run(runs.open(_open("lora:r=4,targets=q_proj"), stream, ME))
    assert "another trainer's adapters" in runs.refusal(_open(), OTHER)
    assert "another trainer's adapters" in runs.refusal(ParamsFetch(start=0, end=2, run_id="mine"), OTHER)
    assert runs.refusal(TrainPush(run_id="mine", micro_id="m"), OTHER) == ""  # the chain checks it
    assert runs.run_adapter(OTHER, "mine") is None and runs.run_adapter(ME, "mine") is not None
    with pytest.raises(RequestError, match="no adapter 'mine' of yours"):
        runs.resolve(OTHER, "mine", 0, 2)
    runs.shutdown()


def test_loaded_adapters_are_checked_and_kept_per_caller(model_dir: Path) -> None:
    runs = _runs(model_dir, TrainerPolicy(("anyone",)))
    state = LoraAdapter(load_blocks(model_dir, 1, 2), parse_adapter(SPEC), 5).state_dict()
    names = sorted(state)
    flat = torch.cat([state[n].reshape(-1) for n in names])
    load = AdapterLoad(name="file:x", spec=SPEC, start=1, end=2, names=names)
    for request, tensor, says in [
        (AdapterLoad(name="file:x", spec=SPEC, start=0, end=3, names=names), flat, "serves blocks 0:2"),
        (AdapterLoad(name="file:x", spec=SPEC, start=0, end=2, names=names), flat, "do not fit blocks 0:2"),
        (load, flat[:-1], "finite values"),
        (load, torch.full_like(flat, float("nan")), "finite values"),
        (AdapterLoad(name="file:x", spec="lora:r=0,targets=q_proj", start=1, end=2, names=names), flat, "rank"),
    ]:
        with pytest.raises(RequestError, match=says):
            runs.sessions.load(ME, request, tensor)
    assert not runs.sessions.loaded
    runs.sessions.load(ME, load, flat)
    active = runs.resolve(ME, "file:x", 1, 2)
    assert active is not None and len(active) == 2  # q_proj and v_proj of block 1
    with pytest.raises(RequestError, match="no adapter"):
        runs.resolve(OTHER, "file:x", 1, 2)  # another caller's
    with pytest.raises(RequestError, match="no adapter"):
        runs.resolve(ME, "file:x", 0, 2)  # not loaded for block 0
    assert runs.resolve(ME, "", 0, 2) is None
    runs.shutdown()


def test_saved_adapters_resume_for_their_trainer_only(model_dir: Path, tmp_path: Path) -> None:
    """A restarted peer reloads a run's adapters from its checkpoint for the trainer they belong to, nobody else."""
    runs = _runs(model_dir, TrainerPolicy(("anyone",)), tmp_path)
    asyncio.run(runs.open(_open(), object(), ME))
    trainer = runs.get("mine").trainer
    hidden = torch.randn(1, 4, 32)
    trainer.forward("m", hidden, torch.arange(4)[None])
    trainer.backward("m", torch.ones_like(hidden))
    assert trainer.step == 1 and len(runs.save_all("test")) == 1
    runs.shutdown()
    restarted = _runs(model_dir, TrainerPolicy(("anyone",)), tmp_path)
    with pytest.raises(RequestError, match="belong to another trainer"):
        asyncio.run(restarted.open(_open(), object(), OTHER))
    assert restarted.get("mine") is None
    assert asyncio.run(restarted.open(_open(), object(), ME)) == 1
    restarted.shutdown()
