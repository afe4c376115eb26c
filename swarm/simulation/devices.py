"""Device classes and models from public spec figures: what a peer's compute and memory give the planner.

Per token per block, a forward costs ``2 x params`` FLOPs (each weight is one multiply-add; attention's
sequence-dependent part is left out) and a backward twice that. A device runs them at ``peak_flops x utilisation``.
Its memory holds ``floor(memory x usable / (params x bytes_per_param))`` blocks, where ``bytes_per_param`` depends on
what the peer keeps per weight (``MEMORY_MODES``) and ``usable`` leaves room for activations and the runtime.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1e9

# Bytes a stage keeps per weight: fp16 weights alone (serving, or training adapters on frozen weights), or full
# mixed-precision training with Adam (fp16 weights and grads, fp32 master weights, first and second moments).
MEMORY_MODES = {"inference": 2.0, "adapters": 2.0, "full": 16.0}
USABLE = 0.8  # of a device's memory, for blocks (the rest: activations, KV cache, the CUDA context)
UTILISATION = 0.4  # of peak FLOPs that dense transformer blocks reach in practice (MFU of tuned training runs)


@dataclass(frozen=True)
class DeviceClass:
    """A kind of accelerator (or CPU): dense peak half-precision FLOPs with fp32 accumulation (what torch runs), its
    memory, and the rate it reads weights from local disk."""

    name: str
    peak_flops: float
    memory_bytes: float
    disk_bytes_per_s: float = 1.0 * GB
    utilisation: float = UTILISATION

    def __post_init__(self) -> None:
        for field_name in ("peak_flops", "memory_bytes", "disk_bytes_per_s", "utilisation"):
            value = getattr(self, field_name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"DeviceClass.{field_name} must be a finite number > 0, got {value!r}")

    @property
    def flops(self) -> float:
        """FLOPs per second it sustains."""
        return self.peak_flops * self.utilisation


# Public spec sheets (dense, no sparsity). GeForce Ampere/Ada run fp16 tensor ops with fp32 accumulation at half the
# rate they quote for fp16 accumulation (RTX 3080: 59.5 vs 119 TFLOPS; GA102 and AD102 whitepapers).
CATALOG: dict[str, DeviceClass] = {d.name: d for d in (
    DeviceClass("rtx3060", 25.6e12, 12 * GB),  # GA106, fp16 tensor fp32-acc 25.6 (51.2 fp16-acc)
    DeviceClass("rtx3080", 59.5e12, 10 * GB),  # GA102, 10 GB GDDR6X; 29.8 TFLOPS fp32, 119 fp16-acc tensor
    DeviceClass("rtx3090", 71.0e12, 24 * GB),  # GA102, 24 GB
    DeviceClass("rtx4090", 165.2e12, 24 * GB),  # AD102, 24 GB; 330 fp16-acc tensor
    DeviceClass("t4", 65.0e12, 16 * GB),  # Turing, fp16 mixed precision
    DeviceClass("a100", 312e12, 80 * GB, disk_bytes_per_s=2 * GB),  # A100 SXM 80 GB, bf16 dense
    DeviceClass("h100", 989e12, 80 * GB, disk_bytes_per_s=2 * GB),  # H100 SXM 80 GB, bf16 dense
    DeviceClass("cpu", 1.5e12, 64 * GB, disk_bytes_per_s=0.5 * GB, utilisation=0.5),  # 16-core AVX-512 desktop, fp32
)}


@dataclass(frozen=True)
class ModelSpec:
    """What the simulation needs of a model: its blocks' parameters and the hidden size (activations on links)."""

    name: str
    num_blocks: int
    params_per_block: int
    hidden_size: int
    dtype_bytes: int = 2  # fp16 weights and activations

    @property
    def block_bytes(self) -> float:
        """Bytes of one block's weights (what a peer loads to serve it)."""
        return self.params_per_block * self.dtype_bytes

    @property
    def forward_flops(self) -> float:
        """FLOPs of one token through one block, forward."""
        return 2.0 * self.params_per_block


def _llama_block(hidden: int, intermediate: int, kv_hidden: int) -> int:
    """Parameters of one Llama block: q and o (h x h), k and v (h x kv), the gated MLP (3 x h x i), two norms."""
    return 2 * hidden * hidden + 2 * hidden * kv_hidden + 3 * hidden * intermediate + 2 * hidden


MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    ModelSpec("llama-2-7b", 32, _llama_block(4096, 11008, 4096), 4096),
    ModelSpec("llama-2-13b", 40, _llama_block(5120, 13824, 5120), 5120),
    ModelSpec("llama-2-70b", 80, _llama_block(8192, 28672, 1024), 8192),  # grouped-query attention: 8 kv heads
)}


@dataclass(frozen=True)
class PeerFigures:
    """A device's figures for one model: seconds per token per block (forward, backward) and blocks it holds."""

    forward_s: float
    backward_s: float
    max_blocks: int


def figures(device: DeviceClass, model: ModelSpec, memory: str = "adapters", usable: float = USABLE) -> PeerFigures:
    """What ``device`` does for ``model``; ``memory`` is a key of ``MEMORY_MODES``. ``max_blocks`` may be 0 (the
    device cannot hold one block: it cannot serve this model)."""
    if memory not in MEMORY_MODES:
        raise ValueError(f"memory must be one of {sorted(MEMORY_MODES)}, got {memory!r}")
    if not 0 < usable <= 1:
        raise ValueError(f"usable must be in (0, 1], got {usable!r}")
    forward = model.forward_flops / device.flops
    per_block = model.params_per_block * MEMORY_MODES[memory]
    blocks = min(model.num_blocks, int(device.memory_bytes * usable // per_block))
    return PeerFigures(forward_s=forward, backward_s=2 * forward, max_blocks=blocks)
