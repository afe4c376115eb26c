"""Text in, text out: the model folder's tokenizer around ``SwarmClient.iter_generate``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer

from peers.client.generation import SamplingConfig


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} has no tokenizer.json: generation needs the model's tokenizer")
    return Tokenizer.from_file(str(path))


def eos_ids(model_dir: str | Path, tokenizer: Tokenizer) -> list[int]:
    """End-of-sequence token ids from the model's config, else the tokenizer's ``</s>``-like tokens."""
    from peers.model import ModelConfig

    ids = list(ModelConfig.from_dir(model_dir).eos_token_ids)
    for name in ("</s>", "<|endoftext|>", "<|end_of_text|>", "<|im_end|>"):
        token = tokenizer.token_to_id(name)
        if token is not None and token not in ids:
            ids.append(token)
    return ids


def stream_text(client, prompt: str, max_new_tokens: int, *, sampling: SamplingConfig) -> Iterator[str]:
    """Yield the prompt, then each decoded piece of new text as soon as its tokens arrive."""
    tokenizer = load_tokenizer(client.model_dir)
    prompt_ids = tokenizer.encode(prompt).ids
    if not prompt_ids:
        raise ValueError("the prompt encodes to no tokens")
    yield prompt
    new_ids: list[int] = []
    shown = ""
    stops = eos_ids(client.model_dir, tokenizer)
    for token in client.iter_generate(torch.tensor([prompt_ids]), max_new_tokens, sampling=sampling,
                                      stop_tokens=stops):
        if int(token[0]) in stops:
            break
        new_ids.append(int(token[0]))
        text = tokenizer.decode(new_ids)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            yield text[len(shown):]
            shown = text
