"""Error feedback: what a lossy codec dropped from one message is added to the next message of the same key.

A sender that compresses the same quantity again and again (a replica's parameter delta every averaging round) keeps,
per key, the residual ``sent + residual - decoded``; the next message encodes ``tensor + residual``. Over n messages
the receiver gets the sum of the n tensors up to one residual, however much top-k drops from each (plain top-k loses
the same small values every time). It is sound only where consecutive messages of a key add up to one quantity: not
for activations of different micro-batches (a residual of one sample would leak into another) and not for the
gradient of a top-k forward (it travels in the same pattern, nothing dropped).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from swarm.compression.codecs import Codec, Encoded, decode, encode

MAX_KEYS = 1024  # residuals kept at most (the oldest key is forgotten beyond it)


class ErrorFeedback:
    """Residuals per key (kept in float32, on the CPU)."""

    def __init__(self) -> None:
        self.residuals: dict[Hashable, torch.Tensor] = {}

    def compress(self, key: Hashable, tensor: torch.Tensor, codec: Codec) -> Encoded:
        """``tensor`` plus the key's residual, encoded in ``codec``; what the codec lost becomes the new residual.
        A tensor of another shape than the residual's starts the key afresh."""
        corrected = self.corrected(key, tensor)
        encoded = encode(corrected.to(tensor.dtype), codec)
        arrived = decode(encoded.serialized, max_bytes=corrected.numel() * 8).tensor
        self._keep(key, corrected - arrived.to(torch.float32))
        return encoded

    def corrected(self, key: Hashable, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (float32, CPU) plus the residual of ``key``, if it has one of the same shape."""
        value = tensor.detach().to("cpu", torch.float32)
        residual = self.residuals.get(key)
        return value if residual is None or residual.shape != value.shape else value + residual

    def reset(self, key: Hashable | None = None) -> None:
        """Forget the residual of ``key`` (all of them with None): after the receiver lost a message, say."""
        if key is None:
            self.residuals.clear()
        else:
            self.residuals.pop(key, None)

    def _keep(self, key: Hashable, residual: torch.Tensor) -> None:
        self.residuals.pop(key, None)
        if len(self.residuals) >= MAX_KEYS:
            del self.residuals[next(iter(self.residuals))]
        self.residuals[key] = residual
