"""``LocalModel``: embedding, all blocks and head in one process; the reference for demos and tests."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from .blocks import KV, StageBlocks
from .checkpoint import load_blocks, load_client_parts
from .config import ModelConfig

logger = logging.getLogger(__name__)


def default_position_ids(input_ids: torch.Tensor, past_len: int = 0) -> torch.Tensor:
    """Positions ``past_len .. past_len + T - 1`` for every row of ``input_ids [B, T]``."""
    t = input_ids.shape[-1]
    return torch.arange(past_len, past_len + t, device=input_ids.device).expand(input_ids.shape[0], t)


class LocalModel(nn.Module):
    """A whole causal LM built from our own block code."""

    def __init__(
        self, config: ModelConfig, embedding: nn.Module, blocks: StageBlocks, head: nn.Module
    ) -> None:
        super().__init__()
        if (blocks.start, blocks.end) != (0, config.num_layers):
            raise ValueError(
                f"LocalModel needs all {config.num_layers} blocks, got [{blocks.start}, {blocks.end})"
            )
        self.config = config
        self.embedding, self.blocks, self.head = embedding, blocks, head

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = torch.float32,
    ) -> LocalModel:
        """Load every part of the model in ``model_dir``."""
        config = ModelConfig.from_dir(model_dir)
        embedding, head = load_client_parts(model_dir, device=device, dtype=dtype)
        blocks = load_blocks(model_dir, 0, config.num_layers, device=device, dtype=dtype)
        return cls(config, embedding, blocks, head).eval()

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, past: list[KV] | None = None
    ) -> tuple[torch.Tensor, list[KV]]:
        """Logits ``[B, T, vocab]`` for ``input_ids [B, T]`` and the extended per-block KV cache."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if position_ids is None:
            past_len = 0 if past is None else past[0][0].shape[2]
            position_ids = default_position_ids(input_ids, past_len)
        hidden = self.embedding.embed(input_ids, position_ids)
        hidden, past = self.blocks(hidden, position_ids, past)
        return self.head.head(hidden), past

    @torch.inference_mode()
    def generate_greedy(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy continuation with a KV cache; returns ``[B, T + max_new_tokens]`` token ids."""
        if max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        logits, past = self(input_ids)
        out = [input_ids]
        for step in range(max_new_tokens):
            out.append(logits[:, -1:].argmax(-1))
            if step + 1 < max_new_tokens:
                logits, past = self(out[-1], past=past)
        return torch.cat(out, dim=1)
