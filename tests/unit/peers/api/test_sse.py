"""Server-sent events framing and the response objects streamed in it."""

from __future__ import annotations

import json

from peers.api import sse
from peers.api.responses import Reply


def test_an_event_is_one_data_line_and_a_blank_line():
    raw = sse.event({"text": "two\nlines", "é": "ü"})
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n") and raw.count(b"\n") == 2
    assert json.loads(raw[len(b"data: "):]) == {"text": "two\nlines", "é": "ü"}


def test_a_stream_parses_back_with_done_last():
    raw = sse.event({"a": 1}) + sse.event({"b": 2}) + sse.DONE
    assert sse.parse_events(raw) == [{"a": 1}, {"b": 2}, "[DONE]"]


def test_chat_chunks_open_with_the_role_and_end_with_the_reason():
    reply = Reply(model="m", chat=True)
    first, middle, last = reply.chunk(role=True), reply.chunk("hi"), reply.chunk(finish_reason="stop")
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert middle["choices"][0]["delta"] == {"content": "hi"} and middle["object"] == "chat.completion.chunk"
    assert last["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert first["id"] == last["id"] and first["id"].startswith("chatcmpl-")


def test_whole_objects_carry_usage():
    whole = Reply(model="m", chat=False).whole("text", "length", 3, 4)
    assert whole["object"] == "text_completion" and whole["choices"][0]["text"] == "text"
    assert whole["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    usage = Reply(model="m", chat=True).usage_chunk(3, 4)
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 7
