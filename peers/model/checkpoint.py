"""Read a Hugging Face safetensors folder, loading only the tensors a caller asks for.

Supports a single ``model.safetensors`` or shards listed in ``model.safetensors.index.json``.
Blocks are built on the meta device and then take the loaded tensors, so nothing else is allocated.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from .blocks import StageBlocks
from .config import ModelConfig
from .gpt2 import GPT2Block, GPT2Embedding, GPT2Head
from .llama import LlamaBlock, LlamaEmbedding, LlamaHead

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_BLOCKS = {"llama": LlamaBlock, "gpt2": GPT2Block}
_CLIENT = {"llama": (LlamaEmbedding, LlamaHead), "gpt2": (GPT2Embedding, GPT2Head)}
# family -> (optional base prefix, name of the list of layers under it)
_LAYOUT = {"llama": ("model.", "layers"), "gpt2": ("transformer.", "h")}


class Checkpoint:
    """Index of tensor names to safetensors files in a model folder (reads headers only)."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        self.config = ModelConfig.from_dir(self.dir)
        self.weight_map = self._weight_map()
        base, layers = _LAYOUT[self.config.family]
        self.base = base if any(k.startswith(base) for k in self.weight_map) else ""
        self.layers_prefix = f"{self.base}{layers}."

    def _weight_map(self) -> dict[str, str]:
        index = self.dir / INDEX_FILE
        if index.is_file():
            with index.open() as f:
                return dict(json.load(f)["weight_map"])
        single = self.dir / SINGLE_FILE
        if single.is_file():
            with safe_open(str(single), framework="pt") as f:
                return {k: SINGLE_FILE for k in f.keys()}
        raise ValueError(f"no {SINGLE_FILE} or {INDEX_FILE} in {self.dir}: only safetensors checkpoints "
                         "in Hugging Face layout are supported")

    def block_prefix(self, index: int) -> str:
        return f"{self.layers_prefix}{index}."

    def missing(self, what: str) -> ValueError:
        return ValueError(f"checkpoint at {self.dir} lacks {what}: is it a complete Hugging Face folder?")

    def read(
        self, names: list[str], *, device: str | torch.device, dtype: torch.dtype | None
    ) -> dict[str, torch.Tensor]:
        """Load the named tensors, opening each shard that holds some of them once."""
        by_file: dict[str, list[str]] = defaultdict(list)
        for name in names:
            if name not in self.weight_map:
                raise self.missing(f"tensor {name}")
            by_file[self.weight_map[name]].append(name)
        out: dict[str, torch.Tensor] = {}
        for file, keys in by_file.items():
            path = self.dir / file
            if not path.is_file():
                raise self.missing(f"shard {file}")
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                present = set(f.keys())
                for key in keys:
                    if key not in present:
                        raise self.missing(f"tensor {key}")
                    t = f.get_tensor(key)
                    out[key] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        logger.debug("read %d tensors from %d file(s) of %s", len(out), len(by_file), self.dir)
        return out


def _fill(module: nn.Module, tensors: dict[str, torch.Tensor], where: str, strict: bool = True) -> None:
    """Assign loaded tensors into a meta-device module; the result is frozen and in eval mode."""
    try:
        module.load_state_dict(tensors, strict=strict, assign=True)
    except RuntimeError as e:
        raise ValueError(f"tensors for {where} do not fit the config: {e}") from e
    left = [name for name, t in module.state_dict().items() if t.is_meta]
    if left:
        raise ValueError(f"{where} still lacks {left} after loading")
    module.requires_grad_(False).eval()


def load_blocks(
    model_dir: str | Path, start: int, end: int, *, device: str | torch.device = "cpu",
    dtype: torch.dtype | None = torch.float32, progress: Callable[[], None] | None = None,
) -> StageBlocks:
    """Load blocks ``[start, end)`` (and only their tensors) into a ``StageBlocks`` (an ``nn.ModuleList``).

    ``dtype=None`` keeps the checkpoint's dtype; ``progress()`` is called after each block is loaded.
    """
    ckpt = Checkpoint(model_dir)
    n = ckpt.config.num_layers
    if not 0 <= start < end <= n:
        raise ValueError(f"block range [{start}, {end}) is not within the model's {n} blocks")
    block_cls = _BLOCKS[ckpt.config.family]
    with torch.device("meta"):
        blocks = [block_cls(ckpt.config, i) for i in range(start, end)]
    count = 0
    for block in blocks:  # block by block: a progress bar moves, and only one block's tensors wait to be assigned
        prefix = ckpt.block_prefix(block.layer_idx)
        tensors = ckpt.read([prefix + k for k in block.state_dict()], device=device, dtype=dtype)
        _fill(block, {k[len(prefix):]: t for k, t in tensors.items()}, f"block {block.layer_idx}")
        count += len(tensors)
        if progress is not None:
            progress()
    logger.info("loaded blocks [%d, %d) of %s (%d tensors)", start, end, ckpt.config.name, count)
    return StageBlocks(blocks, start, end).eval()


def load_client_parts(
    model_dir: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = torch.float32
) -> tuple[nn.Module, nn.Module]:
    """Load the embedding and the head (final norm + lm_head, tied to the embedding when needed)."""
    ckpt = Checkpoint(model_dir)
    cfg = ckpt.config
    emb_cls, head_cls = _CLIENT[cfg.family]
    with torch.device("meta"):
        embedding, head = emb_cls(cfg), head_cls(cfg)
    tied = cfg.tie_word_embeddings or "lm_head.weight" not in ckpt.weight_map
    if tied and not cfg.tie_word_embeddings:
        logger.warning("%s has no lm_head.weight: tying it to the input embedding", ckpt.dir)
    emb_keys = {k: ckpt.base + k for k in embedding.state_dict()}
    head_keys = {k: k if k == "lm_head.weight" else ckpt.base + k for k in head.state_dict()}
    if tied:
        del head_keys["lm_head.weight"]
    tensors = ckpt.read([*emb_keys.values(), *head_keys.values()], device=device, dtype=dtype)
    _fill(embedding, {k: tensors[v] for k, v in emb_keys.items()}, "the embedding")
    if tied:
        head.lm_head.weight = embedding.state_dict(keep_vars=True)[_tied_key(cfg)]
    _fill(head, {k: tensors[v] for k, v in head_keys.items()}, "the head", strict=not tied)
    return embedding, head


def _tied_key(cfg: ModelConfig) -> str:
    return "embed_tokens.weight" if cfg.family == "llama" else "wte.weight"


def block_class(config: ModelConfig) -> type[nn.Module]:
    """The block class of ``config``'s family (``LlamaBlock``, ``GPT2Block``), built as ``cls(config, layer_idx)``."""
    return _BLOCKS[config.family]
