"""Text in, text out: the model folder's tokenizer around ``SwarmClient.iter_generate``."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer

from peers.client.generation import SamplingConfig

logger = logging.getLogger(__name__)


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
    """Yield the prompt, then each decoded piece of new text as soon as its tokens arrive.

    A multi-byte character split over tokens is held back until it is complete (at most ``MAX_CHAR_TOKENS`` tokens:
    longer runs of invalid bytes are shown as they are, as U+FFFD); what is still held at the end is shown too, with a
    warning on stderr (the log), never dropped."""
    tokenizer = load_tokenizer(client.model_dir)
    prompt_ids = tokenizer.encode(prompt).ids
    if not prompt_ids:
        raise ValueError("the prompt encodes to no tokens")
    yield prompt
    decoder = TextPieces(tokenizer)
    stops = eos_ids(client.model_dir, tokenizer)
    for token in client.iter_generate(torch.tensor([prompt_ids]), max_new_tokens, sampling=sampling,
                                      stop_tokens=stops):
        if int(token[0]) in stops:
            break
        if piece := decoder.add(int(token[0])):
            yield piece
    if rest := decoder.flush():
        yield rest


MAX_CHAR_TOKENS = 4  # a UTF-8 character has at most 4 bytes, so at most 4 byte tokens


class TextPieces:
    """Token ids in, text out as soon as it is final: a trailing incomplete UTF-8 character waits for its next
    bytes, for at most ``MAX_CHAR_TOKENS`` tokens (then it is shown as U+FFFD and never decoded again)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []  # tokens decoded together (so that e.g. SentencePiece spaces come out right)
        self.shown = ""  # the text of ``ids`` already given out
        self.held = 0  # tokens since text was last given out

    def add(self, token: int) -> str:
        """The new final text after ``token`` ('' while a character is incomplete)."""
        self.ids.append(token)
        self.held += 1
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):
            return self._emit(text)
        if self.held < MAX_CHAR_TOKENS:
            return ""  # wait for the rest of a multi-byte character
        piece = self._emit(text)
        self.ids, self.shown = [], ""  # invalid bytes, shown as they are: later tokens must not re-decode them
        return piece

    def flush(self) -> str:
        """What is still held back at the end (an incomplete character, shown as U+FFFD), with a warning."""
        if not self.held:
            return ""
        held = self.held
        rest = self._emit(self.tokenizer.decode(self.ids))
        logger.warning("the generated text ended inside a UTF-8 character: its last %d token(s) are an incomplete "
                       "character, shown as %r; a larger --max_new_tokens lets it finish", held, rest)
        return rest

    def _emit(self, text: str) -> str:
        piece, self.shown, self.held = text[len(self.shown):], text, 0
        return piece
