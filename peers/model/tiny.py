"""``make_tiny_model``: write a small random model folder in Hugging Face layout (no transformers needed).

The folder holds ``config.json``, ``model.safetensors`` (or shards plus
``model.safetensors.index.json``), and a byte-level ``tokenizer.json``: 256 byte tokens (ids 0-255)
followed by ``<s>`` (256), ``</s>`` (257) and ``<pad>`` (258).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from .checkpoint import INDEX_FILE, SINGLE_FILE
from .config import ModelConfig
from .gpt2 import GPT2Block, GPT2Embedding, GPT2Head
from .llama import LlamaBlock, LlamaEmbedding, LlamaHead

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable character."""
    ranges = [("!", "~"), ("¡", "¬"), ("®", "ÿ")]
    mapping = {b: chr(b) for lo, hi in ranges for b in range(ord(lo), ord(hi) + 1)}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def make_byte_tokenizer() -> Tokenizer:
    """Byte-level BPE without merges: every byte is one token, plus the special tokens."""
    chars = byte_to_unicode()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def _hf_config(family: str, *, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
               intermediate_size: int, vocab_size: int, max_position_embeddings: int) -> dict[str, Any]:
    common = {"vocab_size": vocab_size, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
              "pad_token_id": PAD_ID, "initializer_range": 0.02, "torch_dtype": "float32", "use_cache": True}
    if family == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": hidden_size,
                "n_layer": num_layers, "n_head": num_heads, "n_inner": intermediate_size,
                "n_positions": max_position_embeddings, "activation_function": "gelu_new",
                "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True, "scale_attn_weights": True,
                "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0, **common}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden_size,
            "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads, "head_dim": hidden_size // num_heads,
            "intermediate_size": intermediate_size, "hidden_act": "silu",
            "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "rope_scaling": None, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
            "attention_dropout": 0.0, **common}


def _tensor_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Checkpoint key -> shape, in file order (embedding, blocks, head), from our own modules."""
    llama = cfg.family == "llama"
    emb_cls, block_cls, head_cls = (LlamaEmbedding, LlamaBlock, LlamaHead) if llama else (
        GPT2Embedding, GPT2Block, GPT2Head)
    base, layers = ("model.", "layers") if llama else ("transformer.", "h")
    shapes: dict[str, torch.Size] = {}
    with torch.device("meta"):
        shapes.update({base + k: t.shape for k, t in emb_cls(cfg).state_dict().items()})
        for i in range(cfg.num_layers):
            block = block_cls(cfg, i).state_dict()
            shapes.update({f"{base}{layers}.{i}.{k}": t.shape for k, t in block.items()})
        for k, t in head_cls(cfg).state_dict().items():
            if k != "lm_head.weight":
                shapes[base + k] = t.shape
            elif not cfg.tie_word_embeddings:
                shapes[k] = t.shape
    return shapes


def _init(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """Ones/zeros for norm weights/biases, normal(0, 0.02) for everything else."""
    leaf = name.rsplit(".", 2)[-2]
    if "norm" in leaf or leaf.startswith("ln_"):
        return torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
    return torch.randn(shape, generator=gen) * 0.02


def make_tiny_model(
    path: str | Path, *, family: str = "llama", hidden_size: int = 64, num_layers: int = 8,
    num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128, vocab_size: int = 272,
    max_position_embeddings: int = 512, seed: int = 0, shards: int = 1,
) -> Path:
    """Write a deterministic random model of ``family`` ("llama" or "gpt2") into ``path``; return it."""
    if family not in ("llama", "gpt2"):
        raise ValueError(f"family must be 'llama' or 'gpt2', got {family!r}")
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        need = 256 + len(SPECIAL_TOKENS)
        raise ValueError(f"vocab_size={vocab_size} cannot hold the {need} tokenizer tokens")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads and num_heads by num_kv_heads")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    raw = _hf_config(family, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                     num_kv_heads=num_kv_heads, intermediate_size=intermediate_size, vocab_size=vocab_size,
                     max_position_embeddings=max_position_embeddings)
    shapes = _tensor_shapes(ModelConfig.from_dict(raw, name=path.name))
    if not 1 <= shards <= len(shapes):
        raise ValueError(f"shards must be between 1 and {len(shapes)}, got {shards}")
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: _init(name, shape, gen) for name, shape in shapes.items()}
    _write_weights(path, tensors, shards)
    (path / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    make_byte_tokenizer().save(str(path / "tokenizer.json"))
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
               "pad_token": "<pad>", "model_max_length": max_position_embeddings}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    logger.info("wrote tiny %s model (%d layers, %d shard(s)) to %s", family, num_layers, shards, path)
    return path


def _write_weights(path: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    meta = {"format": "pt"}
    if shards == 1:
        save_file(tensors, str(path / SINGLE_FILE), metadata=meta)
        return
    names = list(tensors)
    weight_map: dict[str, str] = {}
    for s in range(shards):
        chunk = names[s * len(names) // shards:(s + 1) * len(names) // shards]
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k] for k in chunk}, str(path / file), metadata=meta)
        weight_map.update(dict.fromkeys(chunk, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
