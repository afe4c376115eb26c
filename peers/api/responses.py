"""OpenAI's response objects: ``text_completion`` / ``chat.completion`` and their streamed chunks."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass
class Reply:
    """One response's identity; builds its whole object or its chunks (``chat`` or plain completions)."""

    model: str
    chat: bool
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    def whole(self, text: str, finish_reason: str | None, prompt_tokens: int, completion_tokens: int) -> dict:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=finish_reason)
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": usage(prompt_tokens, completion_tokens)}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, *, role: bool = False,
              with_usage: bool = False) -> dict:
        """A streamed piece: ``role`` opens a chat reply, ``finish_reason`` ends it."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        choice.update(logprobs=None, finish_reason=finish_reason)
        out = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if with_usage:
            out["usage"] = None  # stream_options.include_usage: null until the last chunk
        return out

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        """The last chunk with ``stream_options.include_usage``: no choices, the counts."""
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage(prompt_tokens, completion_tokens)}

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}
