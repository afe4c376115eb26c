"""The request bodies of ``/v1/completions`` and ``/v1/chat/completions``, checked into frozen dataclasses.

A wrong type or value raises ``ApiError`` 400 naming the parameter; so does a parameter this server does not
implement when it is set to something other than its neutral value (``n`` > 1, ``logprobs``, penalties, tools, ...):
refused rather than ignored, since ignoring it would return something else than the caller asked for. Unknown
parameters (``user``, ``metadata``, ...) are ignored, as OpenAI's own server does with harmless extras.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from peers.api.errors import ApiError, bad_param, unsupported

MAX_STOPS = 4  # as OpenAI
ROLES = ("system", "developer", "user", "assistant")


@dataclass(frozen=True)
class Params:
    """What both endpoints share. ``temperature`` 0 (or ``top_p`` 0) is greedy decoding."""

    model: str
    max_tokens: int | None = None  # None: the server's default, clipped to the context left
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage counts

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_p == 0


@dataclass(frozen=True)
class CompletionRequest:
    params: Params
    prompt: str | tuple[int, ...]  # text, or token ids


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class ChatRequest:
    params: Params
    messages: tuple[Message, ...]


def parse_completion(body: Any) -> CompletionRequest:
    body = _object(body)
    return CompletionRequest(params=_params(body), prompt=_prompt(body.get("prompt")))


def parse_chat(body: Any) -> ChatRequest:
    body = _object(body)
    for name in ("tools", "functions"):
        if body.get(name):
            raise unsupported(name, f"`{name}` is not supported by this server: it generates plain text")
    if body.get("tool_choice") not in (None, "none"):
        raise unsupported("tool_choice", "`tool_choice` is not supported by this server: it generates plain text")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise unsupported("response_format", "only response_format {\"type\": \"text\"} is supported")
    if body.get("top_logprobs"):
        raise unsupported("top_logprobs", "`top_logprobs` is not supported by this server")
    return ChatRequest(params=_params(body, chat=True), messages=_messages(body.get("messages")))


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def _params(body: dict[str, Any], chat: bool = False) -> Params:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_param("model", "`model` is required: a model id from GET /v1/models", "missing_required_parameter")
    _refuse_unsupported(body)
    name = "max_tokens"
    if chat and body.get("max_tokens") is None and body.get("max_completion_tokens") is not None:
        name = "max_completion_tokens"  # the newer name of the same limit
    max_tokens = _int(body, name, minimum=1) if body.get(name) is not None else None
    seed = _int(body, "seed") if body.get("seed") is not None else None
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_param("stream", "`stream` must be true or false")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise bad_param("stream_options", "`stream_options` must be an object like {\"include_usage\": true}")
    if options and not stream:
        raise bad_param("stream_options", "`stream_options` applies only with `stream: true`")
    return Params(
        model=model, max_tokens=max_tokens, temperature=_float(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_float(body, "top_p", 1.0, 0.0, 1.0), stop=_stop(body.get("stop")), seed=seed, stream=stream,
        include_usage=bool(options.get("include_usage", False)),
    )


def _refuse_unsupported(body: dict[str, Any]) -> None:
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise unsupported("n", f"only n=1 is supported (got n={n!r}): send one request per completion; "
                               "concurrent requests are batched on the peers")
    best_of = body.get("best_of")
    if best_of is not None and (not _is_int(best_of) or best_of != 1):
        raise unsupported("best_of", "only best_of=1 is supported")
    if body.get("echo"):
        raise unsupported("echo", "`echo` is not supported by this server")
    if body.get("suffix"):
        raise unsupported("suffix", "`suffix` (insertion) is not supported by this server")
    if body.get("logprobs") not in (None, False):
        raise unsupported("logprobs", "`logprobs` is not supported by this server")
    if body.get("logit_bias"):
        raise unsupported("logit_bias", "`logit_bias` is not supported by this server")
    for name in ("presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value not in (None, 0, 0.0):
            raise unsupported(name, f"`{name}` is not supported by this server (only 0)")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(body: dict[str, Any], name: str, minimum: int | None = None) -> int:
    value = body[name]
    if not _is_int(value):
        raise bad_param(name, f"`{name}` must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise bad_param(name, f"`{name}` must be >= {minimum}, got {value}")
    return value


def _float(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_param(name, f"`{name}` must be a number, got {value!r}")
    if not low <= value <= high:
        raise bad_param(name, f"`{name}` must be between {low:g} and {high:g}, got {value}")
    return float(value)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_param("stop", "`stop` must be a string or a list of strings")
    if len(stops) > MAX_STOPS:
        raise bad_param("stop", f"`stop` takes at most {MAX_STOPS} sequences, got {len(stops)}")
    if any(not s for s in stops):
        raise bad_param("stop", "`stop` sequences must not be empty")
    return tuple(stops)


def _prompt(value: Any) -> str | tuple[int, ...]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise bad_param("prompt", "`prompt` must not be empty")
        return value
    if isinstance(value, list) and value and all(_is_int(t) and t >= 0 for t in value):
        return tuple(value)
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
        raise unsupported("prompt", "only one prompt per request is supported: send one request per prompt; "
                                    "concurrent requests are batched on the peers")
    raise bad_param("prompt", "`prompt` must be a non-empty string or a list of token ids",
                    "missing_required_parameter" if value is None else "invalid_value")


def _messages(value: Any) -> tuple[Message, ...]:
    if not isinstance(value, list) or not value:
        raise bad_param("messages", "`messages` must be a non-empty list of {\"role\", \"content\"} objects",
                        "missing_required_parameter" if value is None else "invalid_value")
    messages = []
    for i, item in enumerate(value):
        param = f"messages[{i}]"
        if not isinstance(item, dict):
            raise bad_param(param, f"{param} must be an object with `role` and `content`")
        role = item.get("role")
        if role not in ROLES:
            raise bad_param(f"{param}.role", f"{param}.role must be one of {', '.join(ROLES)}, got {role!r}")
        messages.append(Message(role=role, content=_content(item.get("content"), f"{param}.content")))
    return tuple(messages)


def _content(value: Any, param: str) -> str:
    """A string, or a list of ``{"type": "text", "text": ...}`` parts (joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise unsupported(param, f"{param}: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                                         "supported")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_param(param, f"{param} must be a string or a list of text parts")
