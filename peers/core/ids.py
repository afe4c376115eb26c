"""Names shared by every room: the dtypes a peer serves and sends, and run ids made safe for file names.

Peer ids are shortened for logs by ``privacy.peer_ids.short_id`` (``swarm`` and ``privacy`` use it too).
"""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def safe_name(text: str, limit: int = 100) -> str:
    """``text`` as one file or folder name: letters, digits and ``-_.`` kept, anything else ``_`` (``run`` if empty)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)[:limit] or "run"
