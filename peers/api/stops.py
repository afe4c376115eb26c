"""Text out of generated tokens as they come: whole characters only, and cut at stop sequences.

``IncrementalDecoder`` decodes a sliding window of the ids (as text-generation-inference does): a token's text is
the window's decoding minus that of the window without it, so tokenizers that strip a leading space still give the
right text, in constant time per token; a token that ends in the middle of a multi-byte character is held back
until the character is complete. ``StopMatcher`` holds back the end of the text while it could be the start of a
stop sequence, so that a stop sequence split over several tokens is still found and never shown.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


class IncrementalDecoder:
    def __init__(self, tokenizer: Decoder) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read]: the window already shown; ids[read:]: not shown yet

    def push(self, token: int) -> str:
        """The new text that ``token`` completes ("" while a character is incomplete)."""
        self.ids.append(token)
        shown = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        if len(text) <= len(shown) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(shown):]

    def flush(self) -> str:
        """Whatever is held back (an incomplete character becomes U+FFFD)."""
        shown = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(shown):]


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.pending = ""  # text held back: it may be the start of a stop sequence

    def push(self, text: str) -> tuple[str, bool]:
        """The text safe to show now, and whether a stop sequence ended the text (the text after it is dropped)."""
        buffer = self.pending + text
        found = [i for i in (buffer.find(s) for s in self.stops) if i >= 0]
        if found:
            self.pending = ""
            return buffer[:min(found)], True
        hold = max((k for s in self.stops for k in range(min(len(s) - 1, len(buffer)), 0, -1)
                    if buffer.endswith(s[:k])), default=0)
        self.pending = buffer[len(buffer) - hold:]
        return buffer[:len(buffer) - hold], False

    def flush(self) -> str:
        """The text held back, once no more text comes."""
        text, self.pending = self.pending, ""
        return text


class TextStream:
    """Tokens in, shown text out: ``IncrementalDecoder`` then ``StopMatcher``."""

    def __init__(self, tokenizer: Decoder, stops: Sequence[str] = ()) -> None:
        self.decoder, self.matcher = IncrementalDecoder(tokenizer), StopMatcher(stops)

    def push(self, token: int) -> tuple[str, bool]:
        return self.matcher.push(self.decoder.push(token))

    def finish(self) -> tuple[str, bool]:
        """The rest once generation ended (by length or an end token), and whether a stop sequence cut it."""
        text, stopped = self.matcher.push(self.decoder.flush())
        return (text, True) if stopped else (text + self.matcher.flush(), False)
