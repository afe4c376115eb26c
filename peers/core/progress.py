"""A progress bar on stderr (rich) for slow steps such as a peer loading its blocks; nothing when stderr is no
terminal (logs stay plain: their start and end lines say the same)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


@contextlib.contextmanager
def load_progress(total: int, description: str, console: Console | None = None) -> Iterator[Callable[[], None]]:
    """Yield ``advance()``, to call once per finished item of ``total``; the bar goes to ``console`` (default:
    stderr, only if it is a terminal)."""
    console = console or Console(stderr=True)
    if not console.is_terminal:
        yield lambda: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(description, total=total)
        yield lambda: progress.advance(task)
