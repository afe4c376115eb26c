"""How a benchmark hands over its result: JSON on stdout, and in its results file unless it was a quick check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def report(result: Any, out: Path, *, write: bool = True) -> None:
    """Print ``result`` as indented JSON and, with ``write``, save it to ``out`` (its folder made if missing)."""
    text = json.dumps(result, indent=2)
    print(text)
    if write:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
