"""How many blocks a peer's memory holds (``PeerRecord.max_blocks``): free device memory (CUDA) or available RAM
(CPU), less a safety margin, over one block's bytes in the serving dtype (x4 when it trains: weights, gradients and
two AdamW moments)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from peers.model import ModelConfig
from peers.model.checkpoint import block_class

logger = logging.getLogger(__name__)

SAFETY_MARGIN = 0.25  # of the free memory left for activations, KV caches, the allocator and everything else
TRAINING_FACTOR = 4  # weights + gradients + AdamW's two moments


def block_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of one block's parameters and buffers in ``dtype`` (built on the meta device: nothing is allocated)."""
    with torch.device("meta"):
        block = block_class(config)(config, 0)
    tensors = [*block.parameters(), *block.buffers()]
    return sum(t.numel() for t in tensors if t.is_floating_point()) * torch.empty((), dtype=dtype).element_size()


def free_bytes(device: torch.device, meminfo: Path = Path("/proc/meminfo")) -> int:
    """Free memory of ``device``: CUDA's free device memory, else the RAM the kernel says is available (0 if
    unknown)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def holdable_blocks(free: int, per_block: int, *, num_layers: int, serving: int = 0, training: bool = False) -> int:
    """Blocks that fit in ``free`` bytes (after ``SAFETY_MARGIN``) besides the ``serving`` ones already loaded, at most
    the model's ``num_layers`` and never fewer than ``serving``."""
    if per_block <= 0:
        return max(serving, 1)
    cost = per_block * (TRAINING_FACTOR if training else 1)
    fits = int(free * (1 - SAFETY_MARGIN)) // cost
    return max(serving, min(num_layers, serving + fits), 1)
