"""Token ids from text, and ``TokenBatches``: deterministic random windows for training plus a held-out split."""

from __future__ import annotations

from pathlib import Path

import torch

HELD_OUT_FRACTION = 0.05


def encode_bytes(text: str) -> torch.Tensor:
    """UTF-8 bytes as ids 0..255 (the tiny models' byte-level tokenizer), a 1-D ``LongTensor``."""
    data = bytearray(text.encode("utf-8"))
    if not data:
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(data, dtype=torch.uint8).long()


def encode_with_tokenizer(model_dir: str | Path, text: str) -> torch.Tensor:
    """Ids from the model's own ``tokenizer.json`` (no special tokens added), a 1-D ``LongTensor``."""
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} has no tokenizer.json: use a Hugging Face model folder with a fast tokenizer")
    ids = Tokenizer.from_file(str(path)).encode(text, add_special_tokens=False).ids
    return torch.tensor(ids, dtype=torch.long)


class TokenBatches:
    """Micro-batches ``[micro_batch, seq_len + 1]`` of windows at seeded random offsets of the training split.

    The last 5% of ``tokens`` is held out for evaluation (``held_out``, ``held_out_windows``) and never
    sampled for training. The same ``tokens`` and ``seed`` always give the same micro-batches.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, micro_batch: int, seed: int = 0) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if seq_len < 1 or micro_batch < 1:
            raise ValueError(f"seq_len and micro_batch must be >= 1, got {seq_len} and {micro_batch}")
        cut = len(tokens) - max(seq_len + 1, int(len(tokens) * HELD_OUT_FRACTION))
        if cut < seq_len + 1:
            raise ValueError(f"{len(tokens)} tokens are too few for seq_len={seq_len}: need at least "
                             f"{2 * (seq_len + 1)} (training windows plus a held-out part); use more text")
        self.tokens = tokens[:cut].long()
        self.held_out = tokens[cut:].long()
        self.seq_len, self.micro_batch, self.seed = seq_len, micro_batch, seed
        self.drawn = 0  # micro-batches returned so far
        self._gen = torch.Generator().manual_seed(seed)

    def next_micro(self) -> torch.Tensor:
        """The next micro-batch of ``input_ids [micro_batch, seq_len + 1]``."""
        width = self.seq_len + 1
        starts = torch.randint(0, len(self.tokens) - width + 1, (self.micro_batch,), generator=self._gen)
        self.drawn += 1
        return torch.stack([self.tokens[s:s + width] for s in starts.tolist()])

    def skip(self, n: int) -> None:
        """Advance past ``n`` micro-batches (to resume where a run stopped)."""
        for _ in range(n):
            self.next_micro()

    def held_out_windows(self, limit: int | None = None) -> torch.Tensor:
        """Non-overlapping held-out windows ``[N, seq_len + 1]`` (at most ``limit``)."""
        width = self.seq_len + 1
        n = len(self.held_out) // width if limit is None else min(limit, len(self.held_out) // width)
        return self.held_out[:n * width].view(n, width)

    def __iter__(self) -> TokenBatches:
        return self

    def __next__(self) -> torch.Tensor:
        return self.next_micro()
