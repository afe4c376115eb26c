"""``--device auto`` and ``--torch_dtype auto``, as in Petals: CUDA when present; the checkpoint's dtype on a GPU
(bfloat16 for a half-precision checkpoint where the GPU supports it, else float16), float32 on the CPU."""

from __future__ import annotations

import torch

from peers.core.ids import DTYPES

AUTO = "auto"
HALF = ("float16", "bfloat16")


def resolve_device(name: str) -> str:
    """``auto``: ``cuda`` when a GPU is visible, else ``cpu``; anything else as it is."""
    if name == AUTO:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def resolve_dtype(name: str, checkpoint_dtype: str, device: str | torch.device) -> str:
    """The dtype name to run in. ``auto``: float32 on the CPU (half precision is slow there and loses accuracy); on a
    GPU the checkpoint's dtype, a half-precision one as bfloat16 where supported (float16 otherwise)."""
    if name != AUTO:
        if name not in DTYPES:
            raise ValueError(f"--torch_dtype must be one of {[*DTYPES, AUTO]}, got {name!r}")
        return name
    if torch.device(device).type != "cuda":
        return "float32"
    wanted = checkpoint_dtype if checkpoint_dtype in DTYPES else "float32"
    if wanted in HALF:
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return wanted
