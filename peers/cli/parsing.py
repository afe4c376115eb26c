"""The ``swarm`` argument parser's manners: every flag's help shows its default, and a typo'd subcommand, flag or
choice gets a "did you mean" (Python 3.11's argparse does neither)."""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Iterable, Sequence

_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to a flag's help unless the help already says its default, or the flag is a switch
    (``store_true``/``store_false``: off/on unless given) or has no default worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, argparse.SUPPRESS) or not action.option_strings \
                or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            return text
        shown = "none" if action.default == [] else "%(default)s"
        return f"{text} (default: {shown})" if text else f"(default: {shown})"


def close_matches(word: str, options: Iterable[str]) -> list[str]:
    """The option that looks most like ``word`` (difflib), if any."""
    return difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)


class SwarmParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors suggest the nearest subcommand, flag or choice."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        match = _CHOICE.search(message)
        if match:
            word, choices = match.group(1), re.findall(r"'([^']*)'", match.group(2))
            if found := close_matches(word, choices):
                message += f"; did you mean {' or '.join(repr(f) for f in found)}?"
        super().error(message)

    def parse_args(self, args: Sequence[str] | None = None, namespace=None):  # type: ignore[override]
        """As argparse's, but unknown flags are named with the nearest known ones of their subcommand."""
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            owner = self._subparser_of(parsed) or self
            hints = []
            for arg in extra:
                flag = arg.split("=", 1)[0]
                if flag.startswith("-") and (found := close_matches(flag, owner._option_string_actions)):
                    hints.append(f"{flag}: did you mean {' or '.join(found)}?")
            more = f" ({'; '.join(hints)})" if hints else f" (see `{owner.prog} --help`)"
            owner.error(f"unrecognized arguments: {' '.join(extra)}{more}")
        return parsed

    def _subparser_of(self, parsed: argparse.Namespace) -> argparse.ArgumentParser | None:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                name = getattr(parsed, action.dest, None)
                return action.choices.get(name) if name else None
        return None


def subcommand_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Every subcommand's parser by name (for tests and help checks)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}
