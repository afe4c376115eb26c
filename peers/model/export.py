"""Write a Hugging Face model folder from loaded (e.g. trained) parts: the embedding, the head and every block.

The tensors keep the names of the model folder they were loaded from (``Checkpoint``), so the result loads wherever
that folder did (``transformers``' ``from_pretrained``, ``swarm peer``); tensors of that folder that no part holds
(say, a rotary buffer) are copied as they are. The other files (tokenizer, generation config, ...) are copied, and
``config.json`` gets the dtype written. The folder is written under a temporary name and renamed into place.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from peers.core.folders import folder_replacing, write_json

from .checkpoint import INDEX_FILE, SINGLE_FILE, Checkpoint

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt")
EXPORT_INFO = "export.json"  # where the weights came from (run, step, sources); transformers ignores it


def hf_tensors(model_dir: str | Path, embedding: nn.Module, head: nn.Module, blocks: Sequence[nn.Module],
               dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The state of ``embedding``, ``head`` and ``blocks`` (all of the model's, in order) under the tensor names of
    ``model_dir``'s checkpoint, in ``dtype``."""
    ckpt = Checkpoint(model_dir)
    cfg = ckpt.config
    if len(blocks) != cfg.num_layers:
        raise ValueError(f"got {len(blocks)} blocks for a model of {cfg.num_layers}")
    out: dict[str, torch.Tensor] = {}
    for i, block in enumerate(blocks):
        out.update({ckpt.block_prefix(i) + k: v for k, v in block.state_dict().items()})
    out.update({ckpt.base + k: v for k, v in embedding.state_dict().items()})
    for k, v in head.state_dict().items():
        if k == "lm_head.weight":
            if not cfg.tie_word_embeddings:  # tied: transformers ties it to the embedding itself
                out[k] = v
        else:
            out[ckpt.base + k] = v
    missing = sorted(set(ckpt.weight_map) - set(out) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()))
    out.update(ckpt.read(missing, device="cpu", dtype=None))
    # safetensors refuses tensors that share memory (a tied head): every tensor gets its own contiguous copy
    return {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous().clone()
            for k, v in out.items()}


def save_hf_folder(model_dir: str | Path, out_dir: str | Path, tensors: dict[str, torch.Tensor], *,
                   info: dict[str, Any] | None = None, overwrite: bool = False) -> Path:
    """``out_dir`` as a Hugging Face folder: ``model.safetensors`` with ``tensors``, ``model_dir``'s other files
    (tokenizer, ...) and its ``config.json`` with the tensors' dtype; ``info`` goes to ``export.json``."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise ValueError(f"{out_dir} exists and is not empty: choose another --out or pass --force")
    if out_dir.resolve() == model_dir.resolve():
        raise ValueError(f"--out {out_dir} is the model folder itself: choose another folder")
    dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors.values() if t.is_floating_point()}
    config = json.loads((model_dir / "config.json").read_text())
    dtype = dtypes.pop() if len(dtypes) == 1 else "float32"
    config["torch_dtype"] = dtype
    if "dtype" in config:  # transformers 5's spelling
        config["dtype"] = dtype
    with folder_replacing(out_dir) as tmp:
        for item in model_dir.iterdir():
            if item.is_file() and item.name not in ("config.json", INDEX_FILE) and \
                    not item.name.endswith(WEIGHT_SUFFIXES):
                shutil.copyfile(item, tmp / item.name)  # follows the HF cache's symlinks
        write_json(tmp / "config.json", config)
        save_file(tensors, str(tmp / SINGLE_FILE), metadata={"format": "pt"})
        if info is not None:
            write_json(tmp / EXPORT_INFO, info, indent=1)
    return out_dir
