"""LoRA adapters of a training run: the spec text (``LoraSpec``) and one stage's adapter (``LoraAdapter``).

A run that names an adapter (``TrainConfig.adapter``, ``TrainOpen.adapter``) trains only low-rank terms on the
projections it targets; the blocks' own weights stay frozen and shared (``peers.model.adapters``). The spec text is
``lora:r=RANK,alpha=ALPHA,targets=NAME+NAME`` (``targets`` are projection names as in Hugging Face / ``peft``:
``q_proj``, ``v_proj``, ... for Llama; ``c_attn``, ``c_proj``, ``c_fc`` for GPT-2). ``scaling = alpha / r``.

Initialisation is ``peft``'s (A uniform in +-1/sqrt(in), B zero) drawn from a generator seeded by the run's seed,
the layer and the projection's name: every stage, and the one-process reference, makes the same adapter whatever
the split.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from peers.model.adapters import LoraDelta, Projection
from peers.model.blocks import StageBlocks
from peers.model.gpt2 import Conv1D

TARGETS = {"llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
           "gpt2": ("c_attn", "c_proj", "c_fc")}
MAX_RANK = 1024
MAX_ALPHA = 1e6
EXAMPLE = "lora:r=8,alpha=16,targets=q_proj+v_proj"


@dataclass(frozen=True)
class LoraSpec:
    """Rank, alpha and the projection names a LoRA adapts."""

    rank: int
    alpha: float
    targets: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def text(self) -> str:
        """The canonical spec text (``parse_adapter`` reads it back)."""
        return f"lora:r={self.rank},alpha={self.alpha:g},targets={'+'.join(self.targets)}"


def parse_adapter(text: str) -> LoraSpec | None:
    """``"lora:r=8,alpha=16,targets=q_proj+v_proj"`` -> ``LoraSpec``; ``""`` -> None (no adapter: base training).
    ``ValueError`` says what is wrong and shows the form. ``alpha`` defaults to ``r``."""
    if not isinstance(text, str):
        raise ValueError(f"adapter must be a string like {EXAMPLE!r}, got {type(text).__name__}")
    text = text.strip()
    if not text:
        return None
    kind, _, rest = text.partition(":")
    if kind != "lora" or not rest:
        raise ValueError(f"adapter {text[:100]!r}: only LoRA adapters are supported, written like {EXAMPLE!r}")
    values: dict[str, str] = {}
    for item in rest.split(","):
        key, eq, value = item.strip().partition("=")
        if not eq or key not in ("r", "alpha", "targets") or key in values:
            raise ValueError(f"adapter {text[:100]!r}: {item.strip()[:40]!r} is not one of r=INT, alpha=NUMBER, "
                             f"targets=NAME+NAME (each once), e.g. {EXAMPLE!r}")
        values[key] = value.strip()
    if "r" not in values or "targets" not in values:
        raise ValueError(f"adapter {text[:100]!r} needs r= and targets=, e.g. {EXAMPLE!r}")
    try:
        rank = int(values["r"])
        alpha = float(values.get("alpha", rank))
    except ValueError:
        raise ValueError(f"adapter {text[:100]!r}: r must be an integer and alpha a number") from None
    if not 1 <= rank <= MAX_RANK:
        raise ValueError(f"adapter {text[:100]!r}: r (the rank) must be in 1..{MAX_RANK}, got {rank}")
    if not (math.isfinite(alpha) and 0 < alpha <= MAX_ALPHA):
        raise ValueError(f"adapter {text[:100]!r}: alpha must be a number in (0, {MAX_ALPHA:g}], got {alpha:g}")
    targets = tuple(dict.fromkeys(t for t in values["targets"].split("+") if t))
    known = sorted({t for names in TARGETS.values() for t in names})
    bad = [t for t in targets if t not in known or not re.fullmatch(r"[a-z_]+", t)]
    if not targets or bad:
        raise ValueError(f"adapter {text[:100]!r}: unknown target(s) {[t[:40] for t in bad] or '(none given)'}; "
                         f"targets are projection names joined by '+', from {known}")
    return LoraSpec(rank, alpha, targets)


def _site_seed(seed: int, layer: int, path: str) -> int:
    digest = hashlib.sha256(f"lora:{seed}:{layer}:{path}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def site_key(layer: int, path: str) -> str:
    """A parameter name for the projection ``path`` of block ``layer`` (``3-self_attn-q_proj``)."""
    return f"{layer}-{path.replace('.', '-')}"


def split_key(key: str) -> tuple[int, str]:
    """``site_key``'s inverse: ``(layer, "self_attn.q_proj")``."""
    layer, _, path = key.partition("-")
    return int(layer), path.replace("-", ".")


def _family(blocks: StageBlocks) -> str:
    return "gpt2" if any(isinstance(m, Conv1D) for m in blocks.modules()) else "llama"


class LoraAdapter(nn.Module):
    """One stage's LoRA: ``lora_A[key] [r, in]`` and ``lora_B[key] [out, r]`` per targeted projection of
    ``blocks``. It holds no reference into the blocks' parameters; ``deltas`` maps the projections to its terms."""

    def __init__(self, blocks: StageBlocks, spec: LoraSpec, seed: int) -> None:
        super().__init__()
        family = _family(blocks)
        missing = [t for t in spec.targets if t not in TARGETS[family]]
        if missing:
            raise ValueError(f"adapter targets {missing} do not exist in this {family} model; its projections are "
                             f"{list(TARGETS[family])}")
        self.spec, self.start, self.end = spec, blocks.start, blocks.end
        self.lora_A, self.lora_B = nn.ParameterDict(), nn.ParameterDict()
        self._sites: list[tuple[str, nn.Module]] = []
        for i, block in enumerate(blocks):
            layer = blocks.start + i
            for path, module in block.named_modules():
                if path.rsplit(".", 1)[-1] not in spec.targets or not isinstance(module, (Projection, Conv1D)):
                    continue
                weight = module.weight
                fan_in, fan_out = (weight.shape[1], weight.shape[0]) if isinstance(module, Projection) \
                    else tuple(weight.shape)
                if spec.rank > min(fan_in, fan_out):
                    raise ValueError(f"adapter rank {spec.rank} exceeds the size of {path} ({fan_in} -> {fan_out}); "
                                     "use a smaller r")
                g = torch.Generator().manual_seed(_site_seed(seed, layer, path))
                a = (torch.rand(spec.rank, fan_in, generator=g, dtype=torch.float64) * 2 - 1) / math.sqrt(fan_in)
                key = site_key(layer, path)
                self.lora_A[key] = nn.Parameter(a.to(weight.device, weight.dtype))
                self.lora_B[key] = nn.Parameter(torch.zeros(fan_out, spec.rank, device=weight.device,
                                                            dtype=weight.dtype))
                self._sites.append((key, module))

    def params(self) -> list[nn.Parameter]:
        """The trainable tensors, in a fixed order (every A, then every B)."""
        return list(self.parameters())

    def deltas(self, weights: Sequence[torch.Tensor] | None = None) -> dict[int, LoraDelta]:
        """The active-adapter map for ``peers.model.adapters.using``; ``weights`` (in ``params`` order) replaces
        the live tensors (a kept copy, staleness 1)."""
        a = dict(self.lora_A.items())
        b = dict(self.lora_B.items())
        if weights is not None:
            n = len(a)
            a = dict(zip(a, weights[:n], strict=True))
            b = dict(zip(b, weights[n:], strict=True))
        return {id(module): LoraDelta(a[key], b[key], self.spec.scaling) for key, module in self._sites}
