"""Request validation of ``swarm api``: good bodies parse, bad ones raise ``ApiError`` 400 naming the parameter."""

from __future__ import annotations

import pytest

from peers.api.errors import ApiError
from peers.api.schemas import Message, parse_chat, parse_completion

BASE = {"model": "m", "prompt": "hi"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_a_completion_parses_with_openai_defaults():
    req = parse_completion(BASE)
    assert req.prompt == "hi"
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.stop, p.seed, p.stream) == (None, 1.0, 1.0, (), None, False)
    assert not p.greedy


def test_parameters_are_read():
    req = parse_completion({**BASE, "max_tokens": 5, "temperature": 0, "top_p": 0.5, "stop": "\n", "seed": 3,
                            "stream": True, "stream_options": {"include_usage": True}, "n": 1, "user": "x"})
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.stop, p.seed, p.stream, p.include_usage) == (
        5, 0.0, 0.5, ("\n",), 3, True, True)
    assert p.greedy


def test_prompt_forms():
    assert parse_completion({**BASE, "prompt": ["one"]}).prompt == "one"
    assert parse_completion({**BASE, "prompt": [1, 2, 3]}).prompt == (1, 2, 3)
    assert parse_completion({**BASE, "prompt": [[4, 5]]}).prompt == (4, 5)


def test_chat_messages_and_text_parts():
    req = parse_chat({**CHAT, "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 7})
    assert req.messages == (Message("system", "be brief"), Message("user", "ab"))
    assert req.params.max_tokens == 7


@pytest.mark.parametrize("body, param, code", [
    ({"prompt": "hi"}, "model", "missing_required_parameter"),
    ({**BASE, "temperature": -1}, "temperature", "invalid_value"),
    ({**BASE, "temperature": 2.5}, "temperature", "invalid_value"),
    ({**BASE, "temperature": "hot"}, "temperature", "invalid_value"),
    ({**BASE, "top_p": 1.5}, "top_p", "invalid_value"),
    ({**BASE, "max_tokens": 0}, "max_tokens", "invalid_value"),
    ({**BASE, "max_tokens": 2.5}, "max_tokens", "invalid_value"),
    ({**BASE, "max_tokens": True}, "max_tokens", "invalid_value"),
    ({**BASE, "seed": "x"}, "seed", "invalid_value"),
    ({**BASE, "n": 2}, "n", "unsupported_parameter"),
    ({**BASE, "best_of": 3}, "best_of", "unsupported_parameter"),
    ({**BASE, "logprobs": 2}, "logprobs", "unsupported_parameter"),
    ({**BASE, "echo": True}, "echo", "unsupported_parameter"),
    ({**BASE, "presence_penalty": 0.5}, "presence_penalty", "unsupported_parameter"),
    ({**BASE, "stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
    ({**BASE, "stop": [""]}, "stop", "invalid_value"),
    ({**BASE, "stop": 3}, "stop", "invalid_value"),
    ({**BASE, "stream": "yes"}, "stream", "invalid_value"),
    ({**BASE, "stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ({**BASE, "prompt": ""}, "prompt", "invalid_value"),
    ({"model": "m"}, "prompt", "missing_required_parameter"),
    ({**BASE, "prompt": ["a", "b"]}, "prompt", "unsupported_parameter"),
    ({**BASE, "prompt": [1, -2]}, "prompt", "invalid_value"),
])
def test_bad_completion_parameters_are_refused(body, param, code):
    with pytest.raises(ApiError) as info:
        parse_completion(body)
    error = info.value.body()["error"]
    assert info.value.status == 400 and error["param"] == param and error["code"] == code
    assert error["type"] == "invalid_request_error" and error["message"]


@pytest.mark.parametrize("body, param", [
    ({"model": "m"}, "messages"),
    ({**CHAT, "messages": []}, "messages"),
    ({**CHAT, "messages": ["hi"]}, "messages[0]"),
    ({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({**CHAT, "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content"),
    ({**CHAT, "tools": [{"type": "function"}]}, "tools"),
    ({**CHAT, "response_format": {"type": "json_object"}}, "response_format"),
    ({**CHAT, "n": 2}, "n"),
])
def test_bad_chat_requests_are_refused(body, param):
    with pytest.raises(ApiError) as info:
        parse_chat(body)
    assert info.value.status == 400 and info.value.param == param


def test_a_body_that_is_not_an_object_is_refused():
    with pytest.raises(ApiError) as info:
        parse_completion([1, 2])
    assert info.value.status == 400
