"""OptimConfig / TrainConfig parsing and validation, and the learning-rate schedule."""

from __future__ import annotations

import math
from pathlib import Path

import msgpack
import pytest
import torch

from peers.training import OptimConfig, TrainConfig, lr_at, make_optimizer


def test_optim_round_trips_through_msgpack() -> None:
    cfg = OptimConfig(lr=3e-4, betas=(0.8, 0.99), warmup_steps=2, total_steps=10, schedule="linear")
    wire = msgpack.unpackb(msgpack.packb(cfg.to_dict()))
    assert OptimConfig.from_dict(wire) == cfg
    assert OptimConfig.from_dict({"lr": 1}) == OptimConfig(lr=1.0)  # an int is a fine float


@pytest.mark.parametrize("d, match", [
    ({"lr": 1e-3, "momentum": 0.9}, r"unknown key\(s\) \['momentum'\]; allowed keys are"),
    ({"lr": "0.001"}, "lr must be a finite number"),
    ({"warmup_steps": True}, "warmup_steps must be an integer"),
    ({"warmup_steps": 1.5}, "warmup_steps must be an integer"),
    ({"betas": [0.9]}, "betas must be a pair"),
    ({"lr": float("nan")}, "lr must be a finite number"),
    ({"lr": -1.0}, "lr must be > 0"),
    ({"schedule": "step"}, "schedule must be one of"),
    ({"warmup_steps": 5, "total_steps": 5}, "must exceed warmup_steps"),
    ({"min_lr_ratio": 2.0}, "min_lr_ratio must lie in"),
])
def test_optim_from_dict_refuses_bad_input(d: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OptimConfig.from_dict(d)


@pytest.mark.parametrize("d, match", [
    ({"lr": 1e30, "clip_norm": 0.0}, "lr must be > 0 and at most 1"),  # the attack: NaN for every client
    ({"lr": 1.5}, "lr must be > 0 and at most 1"),
    ({"eps": 10.0}, r"eps must lie in \(0, 1\]"),
    ({"weight_decay": 1e9}, r"weight_decay must lie in \[0, 1\]"),
    ({"clip_norm": 1e300}, "clip_norm must lie in"),
    ({"clip_norm": -1.0}, "clip_norm must lie in"),
    ({"warmup_steps": 1 << 62}, "warmup_steps must lie in"),
    ({"total_steps": 1 << 62}, "total_steps must lie in"),
])
def test_finding_01_optim_config_from_a_trainer_is_bounded(d: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OptimConfig.from_dict(d)
    assert OptimConfig.from_dict({"lr": 1.0, "clip_norm": 0.0}).clip_norm == 0.0  # 0: no clipping, documented


def test_optim_from_dict_refuses_non_dict() -> None:
    with pytest.raises(ValueError, match="expected a dict"):
        OptimConfig.from_dict([("lr", 1.0)])  # type: ignore[arg-type]


def test_lr_schedule_warmup_and_decays() -> None:
    assert lr_at(OptimConfig(lr=1.0, warmup_steps=4), 0) == 0.25
    assert lr_at(OptimConfig(lr=1.0, warmup_steps=4), 3) == 1.0
    assert lr_at(OptimConfig(lr=1.0, warmup_steps=4), 100) == 1.0  # total_steps=0: constant after warmup
    cos = OptimConfig(lr=1.0, warmup_steps=2, total_steps=12, min_lr_ratio=0.1)
    assert lr_at(cos, 2) == 1.0
    assert math.isclose(lr_at(cos, 7), 0.55)  # half way: min + (1 - min) / 2
    assert math.isclose(lr_at(cos, 12), 0.1) and math.isclose(lr_at(cos, 50), 0.1)
    lin = OptimConfig(lr=1.0, total_steps=10, schedule="linear", min_lr_ratio=0.0)
    assert [lr_at(lin, s) for s in (0, 5, 10)] == [1.0, 0.5, 0.0]
    assert lr_at(OptimConfig(lr=0.5, total_steps=10, schedule="constant"), 9) == 0.5
    with pytest.raises(ValueError):
        lr_at(cos, -1)


def test_make_optimizer_dedupes_and_skips_decay_on_vectors() -> None:
    w, b = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    opt = make_optimizer([w, b, w], OptimConfig(weight_decay=0.1, warmup_steps=10))
    assert [len(g["params"]) for g in opt.param_groups] == [1, 1]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-4)  # first warmup step


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "conf" / "train.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_train_config_from_toml(tmp_path: Path) -> None:
    path = _write(tmp_path, """
model_dir = "models/tiny"
data = "/abs/text.txt"
checkpoint_dir = "ckpt"
checkpoint_every = 5
batch_size = 12
micro_batch = 3
keep_activations = false
rechoose_every = 5

[optim]
lr = 3e-4
betas = [0.9, 0.99]
schedule = "linear"
total_steps = 100
""")
    cfg = TrainConfig.from_toml(path)
    assert cfg.model_dir == (tmp_path / "conf" / "models" / "tiny").resolve()
    assert cfg.checkpoint_dir == (tmp_path / "conf" / "ckpt").resolve()
    assert cfg.data == Path("/abs/text.txt")
    assert cfg.accumulation == 4 and cfg.keep_activations is False and cfg.seq_len == 64
    assert cfg.rechoose_every == 5.0
    assert cfg.optim == OptimConfig(lr=3e-4, betas=(0.9, 0.99), schedule="linear", total_steps=100)


@pytest.mark.parametrize("text, match", [
    ('model_dir = "m"\nbatchsize = 4\n', r"unknown key\(s\) \['batchsize'\]; allowed keys are \[.*'batch_size'"),
    ('model_dir = "m"\n[optim]\nlearning_rate = 1.0\n', r"OptimConfig: unknown key\(s\) \['learning_rate'\]"),
    ('seq_len = 8\n', "model_dir is required"),
    ('model_dir = "m"\nbatch_size = 10\nmicro_batch = 4\n', "must be a multiple of micro_batch"),
    ('model_dir = "m"\nseq_len = "64"\n', "seq_len must be an integer"),
    ('model_dir = "m"\nsteps = 0\n', "steps must be >= 1"),
    ('model_dir = "m"\nrechoose_every = -1\n', "rechoose_every must be >= 0"),
    ('model_dir = "m"\ncheckpoint_every = 3\n', "checkpoint_dir is not"),
    ('model_dir = "m"\noptim = 3\n', "optim must be a table"),
    ('model_dir = \n', "not valid TOML"),
])
def test_train_config_errors(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TrainConfig.from_toml(_write(tmp_path, text))


def test_train_config_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        TrainConfig.from_toml(tmp_path / "nope.toml")


@pytest.mark.parametrize("text", ["none", "fp16", "int8", "topk:0.1/int8", "adaptive"])
def test_train_config_takes_a_compression_setting(text: str) -> None:
    assert TrainConfig(model_dir=Path("m"), compression=text).compression == text


def test_train_config_refuses_a_bad_compression_setting() -> None:
    assert TrainConfig(model_dir=Path("m")).compression == "none"
    with pytest.raises(ValueError, match="compression must be 'none', 'adaptive', 'adaptive:SLACK' or a codec"):
        TrainConfig(model_dir=Path("m"), compression="topk:3")
    for bad in ("adaptive:0.5", "adaptive:nan", "adaptive:x", "adaptive:"):
        with pytest.raises(ValueError, match="needs SLACK in"):
            TrainConfig(model_dir=Path("m"), compression=bad)
    assert TrainConfig(model_dir=Path("m"), compression="adaptive:1.0").compression == "adaptive:1"
