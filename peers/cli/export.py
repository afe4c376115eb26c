"""``swarm export CONFIG.toml --out DIR``: a training run as a Hugging Face folder that loads in ``transformers``.

The embedding and head come from the trainer's checkpoint (``checkpoint_dir/<run_id>/trainer``), the blocks from the
peers that trained them: live over the encrypted links (``--initial_peers``: each block as its peer holds it for the
run, at the trainer's step), or from the peers' checkpoint folders (``--blocks_from``: their ``--checkpoint_dir``s,
``<run_id>/blocks-A-B``). Everything must be at the same step, so the folder is one model, never a mix.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from peers.cli.export_client import run_client
from peers.cli.options import model_name_flag, swarm_flags
from peers.model import ModelConfig, load_blocks, load_client_parts
from peers.model.export import hf_tensors, save_hf_folder
from peers.trainer.state import trainer_checkpoint_path
from peers.training import TrainConfig
from peers.training.state import STATE_FILE, client_part, load_weights, read_state_info, run_checkpoint_dir

logger = logging.getLogger(__name__)


def add_export_command(sub) -> None:
    export = sub.add_parser("export", help="write a trained run as a Hugging Face folder (config, safetensors, "
                                           "tokenizer) that loads in transformers")
    export.add_argument("config", type=Path, metavar="RUN",
                        help="the run's training config (TOML), as given to `swarm train`")
    export.add_argument("--out", type=Path, required=True, help="folder to write (required)")
    export.add_argument("--run_id", default=None, help="the run's id (default: the config file's name, as in "
                                                       "`swarm train`)")
    export.add_argument("--blocks_from", type=Path, nargs="+", default=[], metavar="PEER_CHECKPOINT_DIR",
                        help="read the blocks (or an adapter run's adapters) from these peers' --checkpoint_dir "
                             "folders instead of fetching them from the live peers (default: fetch, with "
                             "--initial_peers)")
    swarm_flags(export, joining=True, new_swarm=False)
    model_name_flag(export)
    export.add_argument("--request_timeout", type=float, default=60.0, help="seconds per block fetched")
    export.add_argument("--force", action="store_true", help="overwrite a non-empty --out folder")
    export.set_defaults(func=_cmd_export)


def _cmd_export(args: argparse.Namespace) -> int:
    from peers.cli.train import default_run_id

    config = TrainConfig.from_toml(args.config)
    run_id = args.run_id or default_run_id(args.config)
    if args.out.exists() and any(args.out.iterdir()) and not args.force:
        raise ValueError(f"{args.out} exists and is not empty: choose another --out or pass --force")
    if config.adapter:  # a LoRA run: its adapters as a peft folder (the base model is unchanged)
        from peers.cli.export_adapter import export_adapter

        return export_adapter(args, config, run_id)
    if config.checkpoint_dir is None:
        raise ValueError(f"{args.config} has no checkpoint_dir, so the trainer never saved the run's embedding and "
                         "head: set checkpoint_dir in the config and train (the peers keep their blocks)")
    trainer_dir = trainer_checkpoint_path(config.checkpoint_dir, run_id)
    if not (trainer_dir / STATE_FILE).is_file():
        raise ValueError(f"no trainer checkpoint of run {run_id!r} at {trainer_dir}: check --run_id (default: the "
                         "config file's name) and that `swarm train` ran with this config")
    info = read_state_info(trainer_dir)
    step = int(info["step"])
    embedding, head = load_client_parts(config.model_dir, dtype=torch.float32)
    load_weights(trainer_dir, client_part(embedding, head), expect={"kind": "trainer", "run_id": run_id})
    n = ModelConfig.from_dir(config.model_dir).num_layers
    blocks = list(load_blocks(config.model_dir, 0, n, dtype=torch.float32))
    if args.blocks_from:
        sources = _blocks_from_folders(blocks, args.blocks_from, run_id, step)
    else:
        sources = _blocks_from_peers(blocks, args, config, run_id, step)
    tensors = hf_tensors(config.model_dir, embedding, head, blocks)
    meta = {"run_id": run_id, "step": step, "steps_done": info.get("steps_done"), "model": info.get("model"),
            "base_model": str(config.model_dir), "blocks": sources}
    out = save_hf_folder(config.model_dir, args.out, tensors, info=meta, overwrite=args.force)
    name = info.get("model") or ModelConfig.from_dir(config.model_dir).name
    print(f"Exported run {run_id} at step {step} to {out}: load it with transformers "
          f"(AutoModelForCausalLM.from_pretrained({str(out)!r})), serve it anew with `swarm peer {out} ...`, or run "
          f"it on the peers that trained it with `swarm generate {out} --model_name {name} --initial_peers ...`",
          flush=True)
    print("export " + json.dumps(meta), flush=True)
    return 0


def _blocks_from_peers(blocks: list[torch.nn.Module], args: argparse.Namespace, config: TrainConfig, run_id: str,
                       step: int) -> list[str]:
    from peers.client.trained import fetch_run_blocks
    from peers.server.span_loading import load_flat

    with run_client(config, args, "the blocks") as client:
        fetched = fetch_run_blocks(client, run_id, step)
    for block in fetched:
        load_flat([blocks[block.index]], block.flat)
    return [f"{b.index}: peer {b.peer_id}" for b in fetched]


def _blocks_from_folders(blocks: list[torch.nn.Module], folders: list[Path], run_id: str, step: int) -> list[str]:
    """Load ``<folder>/<run_id>/blocks-A-B`` saved at ``step`` into ``blocks``; every block must be covered."""
    from peers.model import StageBlocks

    done: dict[int, str] = {}
    skipped = []
    for folder in folders:
        for state in sorted(run_checkpoint_dir(folder, run_id).glob("blocks-*-*/" + STATE_FILE)):
            saved = read_state_info(state.parent)
            start, end = int(saved["start"]), int(saved["end"])
            if int(saved["step"]) != step:
                skipped.append(f"{state.parent} is at step {saved['step']}")
                continue
            if all(i in done for i in range(start, end)):
                continue
            load_weights(state.parent, StageBlocks(blocks[start:end], start, end))
            done.update({i: str(state.parent) for i in range(start, end)})
    missing = [i for i in range(len(blocks)) if i not in done]
    if missing:
        raise ValueError(f"blocks {missing} of run {run_id!r} at the trainer's step {step} are in none of "
                         f"{[str(f) for f in folders]}" + (f" ({'; '.join(skipped)})" if skipped else "") +
                         ": pass every stage peer's --checkpoint_dir, or fetch the blocks live with --initial_peers")
    return [f"{i}: {done[i]}" for i in range(len(blocks))]
