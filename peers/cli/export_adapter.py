"""``swarm export CONFIG.toml --out DIR`` for a run with an ``adapter``: its LoRA adapters as a ``peft`` folder.

The adapters live on the run's stage peers: fetched live (``--initial_peers``, as the run's trainer: ``--identity_path``
of ``swarm train``, since a run's adapters are its trainer's) or read from the peers' ``--checkpoint_dir`` folders
(``--blocks_from``: ``<run_id>/adapter-A-B``). Every span must be at the same step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.nn.utils import vector_to_parameters

from peers.model import ModelConfig, load_blocks
from peers.training import TrainConfig
from peers.training.lora import LoraAdapter, LoraSpec, parse_adapter
from peers.training.lora_files import save_peft_folder
from peers.training.state import STATE_FILE, load_weights, read_state_info, run_checkpoint_dir


def export_adapter(args: argparse.Namespace, config: TrainConfig, run_id: str) -> int:
    spec = parse_adapter(config.adapter)
    assert spec is not None
    n = ModelConfig.from_dir(config.model_dir).num_layers
    spans = _from_folders(config, spec, args.blocks_from, run_id) if args.blocks_from else \
        _from_peers(config, spec, args, run_id)
    at, state, steps, sources = 0, {}, set(), []
    for start, end, step, adapter, source in sorted(spans, key=lambda s: s[0]):
        if start != at:
            continue
        state.update(adapter.state_dict())
        steps.add(step)
        sources.append(f"{start}:{end}: {source}")
        at = end
    if at != n:
        raise ValueError(f"the adapters of run {run_id!r} cover blocks 0:{at} of {n} from what was found "
                         f"({[f'{s[0]}:{s[1]}' for s in spans]}): pass every stage peer's --checkpoint_dir, or "
                         "fetch them live with --initial_peers (as the run's trainer: --identity_path)")
    if len(steps) != 1:
        raise ValueError(f"the spans of run {run_id!r} are at different steps {sorted(steps)}: export when every "
                         "stage has applied the same step (the run's last checkpoint)")
    meta = {"run_id": run_id, "step": steps.pop(), "adapter": spec.text(), "base_model": str(config.model_dir),
            "spans": sources}
    out = save_peft_folder(args.out, spec, config.model_dir, state, info=meta, overwrite=args.force)
    print(f"Exported the adapters of run {run_id} at step {meta['step']} to {out} (peft format): load them with "
          f"peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({str(config.model_dir)!r}), "
          f"{str(out)!r}), or generate with them on the swarm: swarm generate ... --adapter {out}", flush=True)
    print("export " + json.dumps(meta), flush=True)
    return 0


Span = tuple[int, int, int, LoraAdapter, str]


def _adapter(config: TrainConfig, spec: LoraSpec, start: int, end: int) -> LoraAdapter:
    return LoraAdapter(load_blocks(config.model_dir, start, end, dtype=torch.float32), spec, 0)


def _from_folders(config: TrainConfig, spec: LoraSpec, folders: list[Path], run_id: str) -> list[Span]:
    found = []
    for folder in folders:
        for state in sorted(run_checkpoint_dir(folder, run_id).glob("adapter-*-*/" + STATE_FILE)):
            saved = read_state_info(state.parent)
            start, end = int(saved["start"]), int(saved["end"])
            adapter = _adapter(config, spec, start, end)
            load_weights(state.parent, adapter, expect={"kind": "adapter", "adapter": spec.text()})
            found.append((start, end, int(saved["step"]), adapter, str(state.parent)))
    return found


def _from_peers(config: TrainConfig, spec: LoraSpec, args: argparse.Namespace, run_id: str) -> list[Span]:
    from peers.cli.export_client import run_client
    from peers.wire.messages import ParamsFetch
    from swarm.records import PeerState

    found, problems = [], []
    with run_client(config, args, "the adapters") as client:
        for record in sorted(client.records(), key=lambda r: (r.start, r.end, r.peer_id)):
            if record.state != PeerState.ONLINE:
                continue
            try:
                stream = client.loop.run(client.peer_stream(record.peer_id))
                reply, flat = client.loop.run(stream.call(
                    ParamsFetch(start=record.start, end=record.end, run_id=run_id), None, args.request_timeout))
            except Exception as e:
                problems.append(f"{record.start}:{record.end}: {e}")
                continue
            adapter = _adapter(config, spec, record.start, record.end)
            vector_to_parameters(flat.to(torch.float32), adapter.params())
            found.append((record.start, record.end, reply.step, adapter, f"peer {record.peer_id}"))
    if not found and problems:
        raise ValueError(f"no peer gave the adapters of run {run_id!r}: " + " | ".join(problems))
    return found
