"""``OptimConfig`` (AdamW, clipping, lr schedule) and ``TrainConfig`` (one training run, read from TOML).

``OptimConfig`` travels between peers: ``to_dict`` gives plain msgpack-able values and ``from_dict``
checks every key and type, because the dict may come from an untrusted peer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from peers.model.hub import HUB_ID, resolve_model
from swarm.compression.policy import check_setting

from .lora import parse_adapter

SCHEDULES = ("constant", "linear", "cosine")
MAX_LR = 1.0  # AdamW moves every weight by about lr per step: above 1 nothing trains, it only destroys
MAX_CLIP_NORM = 1e6
MAX_STEPS = 1 << 40
_KIND_WORDS = {"int": "an integer", "float": "a finite number", "bool": "true or false", "str": "a string",
               "path": "a path (string)"}


def _check_type(where: str, key: str, value: Any, kind: str) -> Any:
    """Return ``value`` converted to ``kind`` ("int", "float", "str", "bool", "betas", "path", "path?", "str?")."""
    optional = kind.endswith("?")
    base = kind.rstrip("?")
    if optional and value is None:
        return None
    wanted = _KIND_WORDS.get(base, base) + (" or absent" if optional else "")
    bad = ValueError(f"{where}: {key} must be {wanted}, got {value!r} ({type(value).__name__})")
    if base == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if base == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad
        return float(value)
    if base == "bool":
        if not isinstance(value, bool):
            raise bad
        return value
    if base == "str":
        if not isinstance(value, str):
            raise bad
        return value
    if base == "path":
        if not isinstance(value, (str, Path)):
            raise bad
        return Path(value)
    if base == "betas":
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise ValueError(f"{where}: {key} must be a pair of floats like [0.9, 0.95], got {value!r}")
        return tuple(_check_type(where, key, v, "float") for v in value)
    raise AssertionError(f"unknown kind {kind}")


def _refuse_unknown(where: str, given: dict[str, Any], allowed: dict[str, str]) -> None:
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed keys are {sorted(allowed)}")


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW hyper-parameters, gradient clipping and the learning-rate schedule.

    ``clip_norm=0`` disables clipping (AdamW's update stays bounded by the lr, and a peer refuses a step that
    would make a weight non-finite). The lr rises linearly over ``warmup_steps`` and then follows
    ``schedule`` down to ``min_lr_ratio * lr`` at ``total_steps`` (``total_steps=0``: constant after warmup).

    Every value is bounded (lr in (0, 1], eps in (0, 1], weight_decay in [0, 1], ...): the config travels to
    stage peers, which must not take a trainer's ``lr=1e30`` for their blocks.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    warmup_steps: int = 0
    schedule: str = "cosine"
    total_steps: int = 0
    min_lr_ratio: float = 0.1

    _TYPES = {"lr": "float", "betas": "betas", "eps": "float", "weight_decay": "float", "clip_norm": "float",
              "warmup_steps": "int", "schedule": "str", "total_steps": "int", "min_lr_ratio": "float"}

    def __post_init__(self) -> None:
        for key, kind in self._TYPES.items():
            setattr(self, key, _check_type("OptimConfig", key, getattr(self, key), kind))
        problems = []
        if not 0 < self.lr <= MAX_LR:
            problems.append(f"lr must be > 0 and at most {MAX_LR:g} (AdamW moves each weight by about lr per "
                            f"step), got {self.lr:g}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            problems.append(f"betas must lie in [0, 1), got {self.betas}")
        if not 0 < self.eps <= 1:
            problems.append(f"eps must lie in (0, 1], got {self.eps:g}")
        if not 0 <= self.weight_decay <= 1:
            problems.append(f"weight_decay must lie in [0, 1], got {self.weight_decay:g}")
        if not 0 <= self.clip_norm <= MAX_CLIP_NORM:
            problems.append(f"clip_norm must lie in [0, {MAX_CLIP_NORM:g}] (0 disables clipping), got "
                            f"{self.clip_norm:g}")
        if not 0 <= self.warmup_steps <= MAX_STEPS:
            problems.append(f"warmup_steps must lie in [0, {MAX_STEPS}], got {self.warmup_steps}")
        if self.schedule not in SCHEDULES:
            problems.append(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if not 0 <= self.total_steps <= MAX_STEPS:
            problems.append(f"total_steps must lie in [0, {MAX_STEPS}] (0: constant after warmup), got "
                            f"{self.total_steps}")
        elif 0 < self.total_steps <= self.warmup_steps:
            problems.append(f"total_steps ({self.total_steps}) must exceed warmup_steps ({self.warmup_steps}), "
                            "or be 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            problems.append(f"min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}")
        if problems:
            raise ValueError("OptimConfig: " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        """Plain values (floats, ints, str, list) that msgpack and JSON can carry."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["betas"] = list(self.betas)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OptimConfig:
        """Build from ``to_dict`` output; unknown keys or wrong types raise ``ValueError``."""
        if not isinstance(d, dict):
            raise ValueError(f"OptimConfig: expected a dict, got {type(d).__name__}")
        _refuse_unknown("OptimConfig", d, cls._TYPES)
        return cls(**{k: _check_type("OptimConfig", k, v, cls._TYPES[k]) for k, v in d.items()})


_TRAIN_TYPES = {
    "model_dir": "path", "model_name": "str?", "data": "path?", "seq_len": "int", "batch_size": "int",
    "micro_batch": "int", "steps": "int", "in_flight": "int", "average_every": "int", "outer_lr": "float",
    "outer_momentum": "float", "rechoose_every": "float",
    "checkpoint_dir": "path?", "checkpoint_every": "int", "seed": "int", "keep_activations": "bool",
    "compression": "str",
    "staleness": "int",
    "stale_micro_batches": "int",
    "adapter": "str",
    "prompts": "int", "deep_prompts": "bool",
}
_PATH_KEYS = ("model_dir", "data", "checkpoint_dir")


@dataclass(kw_only=True)
class TrainConfig:
    """One training run: model, data, batch geometry, pipeline depth, checkpoints and ``optim``.

    ``batch_size`` sequences make one optimizer step, split into micro-batches of ``micro_batch``
    sequences; ``in_flight`` micro-batches may be in the pipeline at once; ``average_every`` (H)
    averages replicas every H steps (0 = off). ``data=None`` uses the built-in corpus.
    """

    model_dir: Path
    model_name: str | None = None
    data: Path | None = None
    seq_len: int = 64
    batch_size: int = 16
    micro_batch: int = 4
    steps: int = 50
    in_flight: int = 4
    average_every: int = 0
    outer_lr: float = 1.0  # replicas' outer step (DiLoCo: Nesterov SGD on anchor - mean); 1 and 0: plain mean
    outer_momentum: float = 0.0
    rechoose_every: float = 30.0  # seconds between looks for peers that joined a span of the pipeline (0: never)
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0
    seed: int = 0
    keep_activations: bool = True
    # how the run's hidden states and grads travel between stages (``swarm.compression``): "none" (bit-exact), a
    # codec ("fp16", "bf16", "int8", "topk:0.1/int8") or "adaptive" (AdaTopK per link and direction)
    compression: str = "none"
    staleness: int = 0  # 1: asynchronous steps (each step's gradients at the weights before the previous update)
    # with staleness 1: how many of a step's micro-batches start before the previous step is applied (on the weights
    # from before it); the others wait for it. 0: all of them (the most overlap, and the most loss: see the README)
    stale_micro_batches: int = 1
    # prompt tuning (``peers.training.prompts``): ``prompts`` trainable vectors owned by the trainer, prepended to the
    # input; with ``deep_prompts`` also one set per block, added to those positions before each block. The served
    # model (blocks, embedding, head) stays frozen: only the prompts train
    prompts: int = 0
    deep_prompts: bool = False
    optim: OptimConfig = field(default_factory=OptimConfig)
    # a LoRA spec ("lora:r=8,alpha=16,targets=q_proj+v_proj", ``peers.training.lora``): the run trains only these
    # adapters, owned by the run, on frozen shared weights; "" trains the base weights (peers must allow the trainer)
    adapter: str = ""

    def __post_init__(self) -> None:
        for key, kind in _TRAIN_TYPES.items():
            setattr(self, key, _check_type("TrainConfig", key, getattr(self, key), kind))
        if not isinstance(self.optim, OptimConfig):
            raise ValueError(f"TrainConfig: optim must be an OptimConfig, got {type(self.optim).__name__}")
        problems = [f"{k} must be >= 1, got {getattr(self, k)}"
                    for k in ("seq_len", "batch_size", "micro_batch", "steps", "in_flight") if getattr(self, k) < 1]
        problems += [f"{k} must be >= 0, got {getattr(self, k)}"
                     for k in ("average_every", "checkpoint_every", "seed") if getattr(self, k) < 0]
        if self.staleness not in (0, 1):
            problems.append(f"staleness must be 0 (synchronous steps, bit-exact with one process) or 1 "
                            f"(asynchronous: the next step starts while one drains), got {self.staleness}")
        if self.stale_micro_batches < 0:
            problems.append(f"stale_micro_batches must be >= 0 (0: all of a step's), got {self.stale_micro_batches}")
        if self.prompts < 0 or (self.deep_prompts and not self.prompts):
            problems.append(f"prompts must be >= 0 (0: no prompt tuning) and deep_prompts needs prompts >= 1, got "
                            f"prompts={self.prompts}, deep_prompts={self.deep_prompts}")
        elif self.prompts and (self.staleness or not self.keep_activations):
            problems.append("prompt tuning needs staleness = 0 and keep_activations = true")
        if self.prompts and self.adapter:
            problems.append("a run trains LoRA adapters or prompts, not both: drop `adapter` or `prompts`")
        if self.rechoose_every < 0:
            problems.append(f"rechoose_every must be >= 0 seconds, got {self.rechoose_every}")
        if not 0 < self.outer_lr <= 2 or not 0 <= self.outer_momentum < 1:
            problems.append(f"outer_lr must be in (0, 2] and outer_momentum in [0, 1), got {self.outer_lr} and "
                            f"{self.outer_momentum}")
        if not problems and self.batch_size % self.micro_batch:
            problems.append(f"batch_size ({self.batch_size}) must be a multiple of micro_batch ({self.micro_batch})")
        try:
            self.compression = check_setting(self.compression)
        except ValueError as e:
            problems.append(str(e))
        try:
            parse_adapter(self.adapter)
        except ValueError as e:
            problems.append(str(e))
        if self.checkpoint_every and self.checkpoint_dir is None:
            problems.append("checkpoint_every is set but checkpoint_dir is not: set both, or checkpoint_every = 0")
        if problems:
            raise ValueError("TrainConfig: " + "; ".join(problems))

    @property
    def accumulation(self) -> int:
        """Micro-batches per optimizer step."""
        return self.batch_size // self.micro_batch

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, base_dir: Path | None = None) -> TrainConfig:
        """Build from top-level keys plus an ``optim`` table; relative paths are resolved against ``base_dir``."""
        _refuse_unknown("TrainConfig", d, {**_TRAIN_TYPES, "optim": "table"})
        if "model_dir" not in d:
            raise ValueError("TrainConfig: model_dir is required (the model folder in Hugging Face layout)")
        kwargs = {k: _check_type("TrainConfig", k, v, _TRAIN_TYPES[k]) for k, v in d.items() if k != "optim"}
        if base_dir is not None:
            for key in _PATH_KEYS:
                if kwargs.get(key) is not None and not kwargs[key].is_absolute():
                    kwargs[key] = (base_dir / kwargs[key]).resolve()
        if HUB_ID.fullmatch(str(d["model_dir"])) and not kwargs["model_dir"].exists():
            try:  # a hub id in the local HF cache; else a folder still to be made (its loader says what is missing)
                kwargs["model_dir"] = resolve_model(str(d["model_dir"]))
            except ValueError:
                pass
        optim = d.get("optim", {})
        if not isinstance(optim, dict):
            raise ValueError(f"TrainConfig: optim must be a table ([optim]), got {optim!r}")
        return cls(**kwargs, optim=OptimConfig.from_dict(optim))

    @classmethod
    def from_toml(cls, path: str | Path) -> TrainConfig:
        """Read a TOML file: top-level keys and an ``[optim]`` table; paths are relative to the file's folder."""
        try:
            import tomllib  # Python >= 3.11
        except ModuleNotFoundError:  # pragma: no cover - Python 3.10
            try:
                import tomli as tomllib
            except ModuleNotFoundError as e:
                raise ValueError("reading TOML needs Python 3.11+ or the tomli package (pip install tomli)") from e

        path = Path(path)
        try:
            with path.open("rb") as f:
                raw = tomllib.load(f)
        except FileNotFoundError as e:
            raise ValueError(f"training config {path} does not exist") from e
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"training config {path} is not valid TOML: {e}") from e
        try:
            return cls.from_dict(raw, base_dir=path.resolve().parent)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e
