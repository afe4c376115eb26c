"""Save and load one training part: weights + AdamW state (safetensors) and a small ``state.json``.

A part is a stage's ``StageBlocks`` or the trainer's embedding + head (e.g. an ``nn.ModuleDict``).
Layout of the folder: ``weights.safetensors`` (parameters by name, tied ones once),
``optimizer.safetensors`` (``<name>::exp_avg``, ``<name>::exp_avg_sq``, ``<name>::step``) and
``state.json`` (step, parameter shapes, caller's meta such as the block range and optim config); with ``buffers``
also ``buffers.safetensors`` (the module's buffers, e.g. BatchNorm statistics of a graph stage).
The folder is written under a temporary name and renamed into place, so a crash never leaves a
half-written checkpoint at ``directory``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from peers.core.ids import safe_name

WEIGHTS_FILE = "weights.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
BUFFERS_FILE = "buffers.safetensors"
FORMAT = 1
_ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")
TRAINER_DIR = "trainer"  # a run's trainer part: CHECKPOINT_DIR/<run_id>/trainer (``peers.trainer.state``)


def run_checkpoint_dir(checkpoint_dir: str | Path, run_id: str) -> Path:
    """``checkpoint_dir/<run id made safe for a file name>``: a run's folder, holding each peer's ``blocks-A-B`` and
    the trainer's ``trainer`` part (when they share ``checkpoint_dir``)."""
    return Path(checkpoint_dir) / safe_name(run_id)


def stage_checkpoint_path(checkpoint_dir: str | Path, run_id: str, start: int, end: int) -> Path:
    """``checkpoint_dir/<run id>/blocks-START-END``: where a peer saves (and resumes) its span of a run."""
    return run_checkpoint_dir(checkpoint_dir, run_id) / f"blocks-{start}-{end}"


def _named(module: nn.Module) -> dict[str, nn.Parameter]:
    return dict(module.named_parameters())  # de-duplicates tied parameters


def save_stage_state(directory: str | Path, module: nn.Module, optimizer: torch.optim.Optimizer | None, step: int,
                     meta: dict[str, Any], *, buffers: bool = False) -> Path:
    """Write ``module``'s parameters, ``optimizer``'s AdamW state (None: a part without parameters), ``step``/``meta``
    and with ``buffers`` its buffers to ``directory`` atomically."""
    directory = Path(directory)
    params = _named(module)
    weights = {name: p.detach().to("cpu").contiguous() for name, p in params.items()}
    adam: dict[str, torch.Tensor] = {}
    for name, p in params.items():
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        if all(k in state for k in _ADAM_KEYS):
            for k in _ADAM_KEYS:
                t = state[k] if isinstance(state[k], torch.Tensor) else torch.tensor(float(state[k]))
                adam[f"{name}::{k}"] = t.detach().to("cpu").reshape(t.shape or (1,)).contiguous()
    info = {**meta, "format": FORMAT, "step": int(step),
            "params": {name: list(p.shape) for name, p in params.items()}}
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        save_file(weights, str(tmp / WEIGHTS_FILE))
        save_file(adam, str(tmp / OPTIMIZER_FILE))
        if buffers:
            kept = {k: b.detach().to("cpu").contiguous() for k, b in module.named_buffers()}
            save_file(kept, str(tmp / BUFFERS_FILE))
        (tmp / STATE_FILE).write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
        old = None
        if directory.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{directory.name}.old-", dir=directory.parent))
            os.replace(directory, old / "state")
        os.replace(tmp, directory)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def read_state_info(directory: str | Path) -> dict[str, Any]:
    """The ``state.json`` of a saved part."""
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise ValueError(f"no training state at {directory}: expected {STATE_FILE} written by save_stage_state")
    return json.loads(path.read_text())


def load_stage_state(directory: str | Path, module: nn.Module, optimizer: torch.optim.Optimizer | None, *,
                     expect: dict[str, Any] | None = None, buffers: bool = False) -> dict[str, Any]:
    """Load what ``save_stage_state`` wrote into ``module`` and ``optimizer`` (and with ``buffers`` its buffers);
    return ``state.json``.

    Refuses (``ValueError``, nothing changed) a state whose ``expect`` entries (e.g. the block range),
    parameter names or shapes differ from this part.
    """
    directory = Path(directory)
    info = read_state_info(directory)
    for key, want in (expect or {}).items():
        if info.get(key) != want:
            raise ValueError(f"training state at {directory} has {key}={info.get(key)!r} but this part has "
                             f"{key}={want!r}: load the state saved by the matching part")
    params = _named(module)
    weights = load_file(str(directory / WEIGHTS_FILE))
    missing, extra = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
    wrong = sorted(n for n in set(params) & set(weights) if tuple(weights[n].shape) != tuple(params[n].shape))
    if missing or extra or wrong:
        detail = "; ".join(f"{what}: {names[:5]}" for what, names in
                           (("missing", missing), ("unexpected", extra), ("shape differs", wrong)) if names)
        raise ValueError(f"training state at {directory} does not fit this part ({detail}): "
                         "was it saved for another model or block range?")
    adam = load_file(str(directory / OPTIMIZER_FILE))
    bad = sorted(k for k, t in adam.items() if not k.endswith("::step")
                 and tuple(t.shape) != tuple(params.get(k.rsplit("::", 1)[0], t).shape))
    if bad:
        raise ValueError(f"optimizer state at {directory} does not fit this part ({bad[:5]}): the files are "
                         "inconsistent; use another checkpoint")
    kept = _buffers(directory, module) if buffers else {}
    with torch.no_grad():
        for name, b in module.named_buffers():
            if name in kept:
                b.copy_(kept[name])
        for name, p in params.items():
            p.copy_(weights[name])
            keys = [f"{name}::{k}" for k in _ADAM_KEYS]
            if optimizer is None:
                continue
            if all(k in adam for k in keys):
                avg, avg_sq, step = (adam[k] for k in keys)
                optimizer.state[p] = {"step": step.reshape(()).clone(), "exp_avg": avg.to(p.device, p.dtype),
                                      "exp_avg_sq": avg_sq.to(p.device, p.dtype)}
            else:
                optimizer.state.pop(p, None)
    return info


def _buffers(directory: Path, module: nn.Module) -> dict[str, torch.Tensor]:
    """The saved buffers, checked against ``module``'s (names, shapes, dtypes)."""
    path = directory / BUFFERS_FILE
    if not path.is_file():
        raise ValueError(f"training state at {directory} has no {BUFFERS_FILE}: it was saved without the module's "
                         "buffers; use a checkpoint saved by the matching part")
    saved, own = load_file(str(path)), dict(module.named_buffers())
    wrong = sorted(k for k in set(saved) | set(own) if k not in saved or k not in own
                   or saved[k].shape != own[k].shape or saved[k].dtype != own[k].dtype)
    if wrong:
        raise ValueError(f"buffers at {directory} do not fit this part ({wrong[:5]}): was it saved for another "
                         "graph or node range?")
    return saved


def load_weights(directory: str | Path, module: nn.Module, *, expect: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load only the weights of a saved part into ``module`` (e.g. to run what a run trained); return ``state.json``.

    Refuses (``ValueError``, nothing changed) a state whose ``expect`` entries, parameter names or shapes differ."""
    directory = Path(directory)
    info = read_state_info(directory)
    for key, want in (expect or {}).items():
        if info.get(key) != want:
            raise ValueError(f"the state at {directory} has {key}={info.get(key)!r}, not {want!r}")
    params = _named(module)
    weights = load_file(str(directory / WEIGHTS_FILE))
    wrong = sorted(set(params) ^ set(weights)) + sorted(n for n in set(params) & set(weights)
                                                         if tuple(weights[n].shape) != tuple(params[n].shape))
    if wrong:
        raise ValueError(f"the weights at {directory} do not fit this model ({wrong[:5]}): were they saved for "
                         "another model?")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name])
    return info


def client_part(embedding: nn.Module, head: nn.Module) -> nn.ModuleDict:
    """A trainer's part as it is saved: embedding + head (a tied head's weight once, as the embedding's)."""
    return nn.ModuleDict({"embedding": embedding, "head": head})


def trainer_part_dir(path: str | Path) -> Path:
    """The trainer part of a run checkpoint: ``path`` itself, or ``path/trainer`` (``CHECKPOINT_DIR/<run_id>``)."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path
    if (path / TRAINER_DIR / STATE_FILE).is_file():
        return path / TRAINER_DIR
    raise ValueError(f"no trainer checkpoint at {path}: pass CHECKPOINT_DIR/RUN_ID (the checkpoint_dir of the "
                     f"training config, and the run's id: the config file's name unless --run_id was given) or its "
                     f"{TRAINER_DIR}/ folder")
