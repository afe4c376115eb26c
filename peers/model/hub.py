"""Models named by a Hugging Face hub id (``org/name``), found in the local HF cache, offline.

``resolve_model`` turns what a user typed (a folder, or a hub id such as ``Qwen/Qwen2.5-0.5B``) into a model folder;
it never downloads. ``cache_name`` gives the swarm name of a folder inside the HF cache
(``.../models--org--name/snapshots/<commit>`` -> ``org--name``), so a hub id and its snapshot path name the same
model, never a commit hash.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name (what `hf download` takes)


def hub_cache_dir() -> Path:
    """The HF hub cache as the environment says now: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else the default."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def resolve_model(ref: str | Path) -> Path:
    """A model folder for ``ref``: the folder itself if it exists, else the cached snapshot of hub id ``ref``.

    ``ValueError`` saying what to do when ``ref`` is neither a folder nor a hub id in the local cache."""
    path = Path(ref).expanduser()
    if path.exists():
        return path
    text = str(ref)
    if not HUB_ID.fullmatch(text):
        raise ValueError(f"{text} is neither a model folder nor a Hugging Face hub id (org/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        found = snapshot_download(text, cache_dir=str(cache), local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError) as e:
        raise ValueError(f"{text} is not a folder and not in the local Hugging Face cache ({cache}); download it "
                         f"first with `hf download {text}` (huggingface_hub's CLI, on a machine with internet; "
                         f"set HF_HUB_CACHE or HF_HOME to use another cache), or pass the model folder") from e
    folder = Path(str(found))
    if not (folder / "config.json").is_file():
        raise ValueError(f"the cached snapshot of {text} ({folder}) has no config.json: download the whole model "
                         f"with `hf download {text}`")
    return folder


def cache_name(path: str | Path) -> str | None:
    """``org--name`` for a snapshot folder of the HF cache (``models--org--name/snapshots/<commit>``), else None."""
    for candidate in (Path(path), Path(path).resolve()):
        if _is_snapshot(candidate):
            return candidate.parent.parent.name.removeprefix("models--")
    return None


def _is_snapshot(path: Path) -> bool:
    return path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--")
