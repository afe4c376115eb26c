"""Writing a whole folder atomically: readers see the old folder or the complete new one, never half of it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def folder_replacing(out_dir: Path) -> Iterator[Path]:
    """A temporary folder beside ``out_dir`` to fill; when the block ends without an error it replaces ``out_dir``
    (an existing one is removed first), else it is removed and ``out_dir`` stays as it was."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        yield tmp
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json(path: Path, value: Any, indent: int = 2) -> None:
    """``value`` as sorted, indented JSON with a final newline."""
    path.write_text(json.dumps(value, indent=indent, sort_keys=True) + "\n")
