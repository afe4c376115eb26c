"""Compact transformer block code for the Llama family (Llama 2/3, Qwen2, Mistral) and GPT-2.

Files:
    config.py      ``ModelConfig`` parsed from a Hugging Face ``config.json`` (``ModelConfig.from_dir``).
    blocks.py      the common block interface: ``KV``, ``causal_attention``, ``StageBlocks`` (a block range).
    adapters.py    per-call LoRA: the adapter active in this call's context, added by the projections (``using``).
    llama.py       ``LlamaBlock`` (RMSNorm, GQA + RoPE, SwiGLU), ``LlamaEmbedding``, ``LlamaHead``.
    gpt2.py        ``GPT2Block`` (Conv1D layout, gelu_new), ``GPT2Embedding``, ``GPT2Head``.
    checkpoint.py  ``load_blocks`` / ``load_client_parts``: read only the needed safetensors tensors.
    local.py       ``LocalModel``: the whole model in one process, the numerical reference.
    tiny.py        ``make_tiny_model``: a random HF-layout model folder with a byte-level tokenizer.

Block interface: ``block(hidden [B, T, H], position_ids [B, T], past_kv=None) -> (hidden, (k, v))``,
where ``(k, v)`` is ``past_kv`` extended by this call (each ``[B, kv_heads, seq, head_dim]``).
Embeddings offer ``embed(input_ids, position_ids)``; heads offer ``head(hidden) -> logits``.
"""

from .blocks import KV, Block, StageBlocks, causal_attention
from .checkpoint import Checkpoint, load_blocks, load_client_parts
from .config import ModelConfig, parse_dtype
from .gpt2 import GPT2Block, GPT2Embedding, GPT2Head
from .llama import LlamaBlock, LlamaEmbedding, LlamaHead
from .local import LocalModel, default_position_ids
from .tiny import make_byte_tokenizer, make_tiny_model

__all__ = [
    "KV", "Block", "StageBlocks", "causal_attention",
    "Checkpoint", "load_blocks", "load_client_parts",
    "ModelConfig", "parse_dtype",
    "GPT2Block", "GPT2Embedding", "GPT2Head",
    "LlamaBlock", "LlamaEmbedding", "LlamaHead",
    "LocalModel", "default_position_ids",
    "make_byte_tokenizer", "make_tiny_model",
]
