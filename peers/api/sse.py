"""Server-sent events as OpenAI streams them: ``data: {json}`` events, then ``data: [DONE]``."""

from __future__ import annotations

import json
from typing import Any

CONTENT_TYPE = "text/event-stream"
DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no buffering by proxies


def event(payload: dict[str, Any]) -> bytes:
    """One event: a single ``data:`` line (JSON has no raw newlines) and the blank line that ends it."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def parse_events(raw: bytes) -> list[Any]:
    """The payloads of a whole stream (``"[DONE]"`` as a string): for tests and benchmarks."""
    out: list[Any] = []
    for block in raw.decode().split("\n\n"):
        data = [line[len("data:"):].strip() for line in block.splitlines() if line.startswith("data:")]
        if data:
            text = "\n".join(data)
            out.append(text if text == "[DONE]" else json.loads(text))
    return out
