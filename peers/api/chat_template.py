"""Chat messages -> prompt text: the model's own chat template, else a plain documented fallback.

The template is ``chat_template`` in the model folder's ``tokenizer_config.json`` (or a ``chat_template.jinja``
file), rendered with Jinja as ``transformers``' ``apply_chat_template`` does (sandboxed, ``trim_blocks``,
``lstrip_blocks``, ``raise_exception``, ``tojson``, the special tokens as variables, ``add_generation_prompt``).
A template writes its own special tokens (``bos_token``...), so its text is encoded without adding them again.

The fallback, for models without a template (base models)::

    System: You are terse.
    User: Hi
    Assistant: Hello.
    User: And now?
    Assistant:

with ``"\\nUser:"`` as a stop sequence, so that the reply ends where the model would start the next turn.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

FALLBACK_NAMES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
FALLBACK_STOPS = ("\nUser:",)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class ChatPrompt:
    text: str
    add_special_tokens: bool  # encode with the tokenizer's own BOS etc. (the fallback) or not (a template wrote them)
    stops: tuple[str, ...] = ()  # stop sequences the format implies


class ChatTemplate:
    """Renders messages (``[{"role", "content"}]``) for one model folder."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        config = _read_json(model_dir / "tokenizer_config.json")
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        jinja_file = model_dir / "chat_template.jinja"
        if not source and jinja_file.is_file():
            source = jinja_file.read_text()
        self.source: str | None = source if isinstance(source, str) and source.strip() else None
        self.variables = {name: _token_text(config.get(name)) for name in SPECIAL_TOKENS}
        self._template = _compile(self.source) if self.source else None

    @property
    def has_template(self) -> bool:
        return self._template is not None

    def render(self, messages: Sequence[dict[str, str]]) -> ChatPrompt:
        """The prompt that asks the model for the assistant's next reply."""
        if self._template is None:
            return fallback_prompt(messages)
        from jinja2 import TemplateError

        try:
            text = self._template.render(messages=list(messages), add_generation_prompt=True, tools=None,
                                         documents=None, **self.variables)
        except TemplateError as e:  # e.g. the template's raise_exception("roles must alternate ...")
            raise ValueError(f"the model's chat template refused these messages: {e}") from None
        return ChatPrompt(text=text, add_special_tokens=False)


def fallback_prompt(messages: Sequence[dict[str, str]]) -> ChatPrompt:
    lines = [f"{FALLBACK_NAMES.get(m['role'], m['role'].title())}: {m['content']}" for m in messages]
    return ChatPrompt(text="\n".join([*lines, "Assistant:"]), add_special_tokens=True, stops=FALLBACK_STOPS)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"could not read {path}: {e}") from None
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str:
    """A special token as written in tokenizer_config.json: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _compile(source: str):
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ValueError(f"the model's chat template does not compile: {e}") from None
