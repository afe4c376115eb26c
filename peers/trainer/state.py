"""Save and load the trainer's own part of a run: embedding + head (in a prompt run, the prompts), their AdamW state,
steps and data position.

The stage peers save their blocks themselves (``swarm peer --checkpoint_dir``); this is the other half. It
uses ``peers.training.state`` on an ``nn.ModuleDict(embedding=..., head=...)``, so a head tied to the
embedding is saved once. ``state.json`` holds ``kind="trainer"``, the ``run_id``, ``steps_done`` and the
caller's ``extra`` (e.g. how many micro-batches of the data were drawn).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from peers.training.state import (
    STATE_FILE,
    TRAINER_DIR,
    client_part,
    load_stage_state,
    run_checkpoint_dir,
    save_stage_state,
)

if TYPE_CHECKING:
    from peers.trainer.swarm_trainer import SwarmTrainer

KIND = "trainer"


def trainer_checkpoint_path(checkpoint_dir: str | Path, run_id: str) -> Path:
    """``checkpoint_dir/<run_id>/trainer``: next to the peers' ``<run_id>/blocks-A-B`` if they share the folder."""
    return run_checkpoint_dir(checkpoint_dir, run_id) / TRAINER_DIR


def has_trainer_state(directory: str | Path) -> bool:
    """True if ``directory`` holds a saved trainer part."""
    return (Path(directory) / STATE_FILE).is_file()


def _part(trainer: SwarmTrainer) -> nn.Module:
    """What the trainer trains: embedding + head, or in a prompt run its prompts (``input``, ``deep``)."""
    prompts = getattr(trainer, "prompts", None)
    return prompts if prompts is not None else client_part(trainer.client.embedding, trainer.client.head)



def save_trainer_state(trainer: SwarmTrainer, directory: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """Write the trainer's embedding + head, their AdamW state, ``steps_done`` and ``extra`` atomically."""
    meta = {**(extra or {}), "kind": KIND, "run_id": trainer.run_id, "steps_done": int(trainer.steps_done)}
    if getattr(trainer, "prompts", None) is not None:  # a prompt run's part: the prompts (``peers.training.prompts``)
        meta["prompts"] = trainer.prompts.count
    return save_stage_state(directory, _part(trainer), trainer.part.optimizer, trainer.part.step_count, meta)


def load_trainer_state(trainer: SwarmTrainer, directory: str | Path) -> dict[str, Any]:
    """Restore what ``save_trainer_state`` wrote into ``trainer``; return ``state.json`` (with the ``extra`` keys).

    Refuses (``ValueError``, nothing changed) a state of another run or another model.
    """
    info = load_stage_state(directory, _part(trainer), trainer.part.optimizer,
                            expect={"kind": KIND, "run_id": trainer.run_id})
    trainer.part.zero_grad()
    trainer.part.step_count = int(info["step"])
    trainer.steps_done = int(info["steps_done"])
    return info
