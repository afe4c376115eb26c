"""Generated text goes to stdout, logs to stderr, never mixed: on a terminal a log line that comes while the text's
line is open first ends that line (so a warning or an error never lands in the middle of the text)."""

from __future__ import annotations

import logging
import sys
from typing import TextIO


class TextOut:
    """Writes the generated text to ``stream`` (stdout) and remembers whether its last line is open."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream
        self.line_open = False

    @property
    def stream(self) -> TextIO:
        return self._stream or sys.stdout

    def write(self, text: str) -> None:
        if text:
            self.stream.write(text)
            self.stream.flush()
            self.line_open = not text.endswith("\n")

    def end_line(self) -> None:
        """End the open line (nothing if none is open)."""
        if self.line_open:
            self.write("\n")

    def shares_screen(self, other: TextIO) -> bool:
        """Whether ``other`` (stderr) shows on the same terminal as the text, so that a log would break its line."""
        try:
            return self.stream.isatty() and other.isatty()
        except (AttributeError, ValueError):
            return False


TEXT = TextOut()


class LineBreakingHandler(logging.Handler):
    """Wraps the log handler: before a record is shown on the terminal the text is on, the text's line is ended."""

    def __init__(self, inner: logging.Handler, stderr: TextIO, text: TextOut = TEXT) -> None:
        super().__init__(inner.level)
        self.inner, self.stderr, self.text = inner, stderr, text

    def emit(self, record: logging.LogRecord) -> None:
        if self.text.line_open and self.text.shares_screen(self.stderr):
            self.text.end_line()
        self.inner.handle(record)

    def setFormatter(self, fmt: logging.Formatter | None) -> None:  # noqa: N802 - logging's name
        self.inner.setFormatter(fmt)
