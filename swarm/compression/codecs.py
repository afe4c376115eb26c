"""Codecs for tensors between stages: how a tensor travels in one ``runtime_pb2.Tensor``.

``none`` is today's wire, byte for byte (hivemind's serialization; bfloat16 kept at 2 bytes per value). Every other
codec marks the message with ``compression = CODED`` and starts its buffer with a 16-byte header (magic, codec,
how top-k values travel, how its index set travels, and how many values it keeps); ``size`` and ``dtype`` stay
those of the decoded tensor. Encoding happens before sealing and decoding after unsealing, so the header is
authenticated with the data on an encrypted stream.

Decoding checks every declared size against the buffer and the caller's ``max_bytes`` (of the dense tensor) before
anything is allocated, and every index (in range, strictly increasing); anything else is refused with
``ValueError("malformed coded tensor: ...")``.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2

CODECS = ("none", "fp16", "bf16", "int8", "topk")
VALUE_CODECS = ("none", "fp16", "bf16", "int8")  # how top-k's kept values travel
FLOAT_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CODED = 64  # ``runtime_pb2.Tensor.compression`` of a coded tensor (outside hivemind's CompressionType values)
MAGIC = b"FSC1"
HEADER = struct.Struct("<4sBBBBQ")  # magic, codec, values, index kind, reserved (0), kept count (top-k)
INT8_BLOCK = 128  # int8: values per block, each block with one float32 scale (its absmax / 127)
MAX_DIMS = 8

_CODEC_IDS = {"fp16": 1, "bf16": 2, "int8": 3, "topk": 4}
_VALUE_IDS = {"none": 0, "fp16": 1, "bf16": 2, "int8": 3}
_INDEX_NONE, _INDEX_LIST, _INDEX_BITMAP = 0, 1, 2
_MAX_INT32 = (1 << 31) - 1
_FP16_MAX = torch.finfo(torch.float16).max


@dataclass(frozen=True)
class Codec:
    """How one tensor travels.

    * ``none``: bit-exact (the tensor's own bytes).
    * ``fp16``: IEEE half. Relative error <= 2^-11 for |x| in fp16's normal range [2^-14, 65504]; absolute error
      <= 2^-25 below it; values beyond +-65504 (and infinities) are clamped to +-65504; NaN stays NaN. Exact for
      float16 tensors.
    * ``bf16``: bfloat16 (float32's range). Relative error <= 2^-8 for normal values; exact for bfloat16 tensors.
    * ``int8``: blockwise absmax, ``INT8_BLOCK`` values per block with one float32 scale ``absmax / 127``; per
      value ``|err| <= absmax_of_block / 254`` (plus the rounding into a float16/bfloat16 original: ``|x| * 2^-11``
      resp. ``2^-8``). A block holding a non-finite value decodes to NaN throughout.
    * ``topk``: keeps the ``ceil(fraction * numel)`` values of largest magnitude (or exactly the flat ``indices``
      given to ``encode``), the rest decode to 0; the kept values travel with ``values`` (one of the above, with its
      bound), their index set as int32 indices or a bitmap, whichever is smaller.
    """

    name: str = "none"
    fraction: float = 1.0  # topk only: share of elements kept, in (0, 1]
    values: str = "none"  # topk only: how the kept values travel

    def __post_init__(self) -> None:
        if self.name not in CODECS:
            raise ValueError(f"unknown codec {self.name!r}: use one of {list(CODECS)} (top-k as 'topk:0.1/fp16')")
        if self.values not in VALUE_CODECS:
            raise ValueError(f"top-k values travel as one of {list(VALUE_CODECS)}, not {self.values!r}")
        if not (isinstance(self.fraction, (int, float)) and 0.0 < self.fraction <= 1.0):
            raise ValueError(f"the top-k fraction must be in (0, 1], got {self.fraction!r}")
        if self.name != "topk" and (self.fraction != 1.0 or self.values != "none"):
            raise ValueError(f"only topk takes a fraction and a values codec, not {self.name!r}")

    @classmethod
    def parse(cls, text: str) -> Codec:
        """``"none"``, ``"fp16"``, ``"bf16"``, ``"int8"``, ``"topk:0.1"`` or ``"topk:0.1/fp16"``."""
        text = text.strip()
        if not text.startswith("topk"):
            return cls(text)
        head, _, values = text.partition("/")
        name, colon, fraction = head.partition(":")
        if name != "topk" or not colon:
            raise ValueError(f"codec {text!r}: top-k needs its fraction, e.g. 'topk:0.1' or 'topk:0.1/int8'")
        try:
            share = float(fraction)
        except ValueError:
            raise ValueError(f"codec {text!r}: the top-k fraction {fraction!r} is no number") from None
        if not math.isfinite(share):
            raise ValueError(f"codec {text!r}: the top-k fraction must be in (0, 1]")
        return cls("topk", share, values or "none")

    def __str__(self) -> str:
        if self.name != "topk":
            return self.name
        return f"topk:{self.fraction!r}" + ("" if self.values == "none" else f"/{self.values}")

    @property
    def exact(self) -> bool:
        return self.name == "none"


NONE = Codec()


@dataclass(frozen=True)
class Encoded:
    """A tensor ready for the wire, and (top-k) the sorted flat indices it kept."""

    serialized: runtime_pb2.Tensor
    indices: torch.Tensor | None = None


@dataclass(frozen=True)
class Decoded:
    """The dense tensor (original shape and dtype) and, for a top-k message, the sorted flat indices it carried."""

    tensor: torch.Tensor
    indices: torch.Tensor | None = None


# ---- encoding ----------------------------------------------------------------------------------------------
def serialize_none(tensor: torch.Tensor) -> runtime_pb2.Tensor:
    """The ``none`` codec: hivemind's serialization, except that bfloat16 keeps its 2 bytes per value (hivemind's
    default widens it to float32); every hivemind reads both."""
    tensor = tensor.detach().cpu()
    if tensor.dtype != torch.bfloat16:
        return serialize_torch_tensor(tensor)
    return runtime_pb2.Tensor(compression=runtime_pb2.CompressionType.NONE, size=tensor.shape, dtype="bfloat16",
                              buffer=tensor.contiguous().view(torch.int16).numpy().tobytes())


def encode(tensor: torch.Tensor, codec: Codec = NONE, *, indices: torch.Tensor | None = None) -> Encoded:
    """``tensor`` in ``codec``. With ``indices`` (top-k only), keep exactly those flat indices (any order, unique):
    the backward of a top-k forward sends its gradient in the same pattern."""
    if indices is not None and codec.name != "topk":
        raise ValueError(f"indices are for the topk codec, not {codec}")
    if codec.name == "none":
        return Encoded(serialize_none(tensor))
    tensor = tensor.detach().cpu()
    dtype = _dtype_name(tensor.dtype)
    if dtype is None:
        raise ValueError(f"codec {codec} takes float32, float16 or bfloat16 tensors, not {tensor.dtype}")
    flat = tensor.reshape(-1)
    kept: torch.Tensor | None = None
    if codec.name == "topk":
        kept = _kept_indices(flat, codec.fraction, indices)
        body = _index_bytes(kept, flat.numel()) + _value_bytes(flat[kept], codec.values)
        header = HEADER.pack(MAGIC, _CODEC_IDS["topk"], _VALUE_IDS[codec.values],
                             _index_kind(flat.numel(), kept.numel()), 0, kept.numel())
    else:
        body = _value_bytes(flat, codec.name)
        header = HEADER.pack(MAGIC, _CODEC_IDS[codec.name], 0, _INDEX_NONE, 0, 0)
    serialized = runtime_pb2.Tensor(compression=CODED, size=tensor.shape, dtype=dtype, buffer=header + body)
    return Encoded(serialized, kept)


def _dtype_name(dtype: torch.dtype) -> str | None:
    return next((name for name, d in FLOAT_DTYPES.items() if d == dtype), None)


def _kept_count(numel: int, fraction: float) -> int:
    return 0 if numel == 0 else min(numel, max(1, math.ceil(fraction * numel - 1e-9)))


def _kept_indices(flat: torch.Tensor, fraction: float, indices: torch.Tensor | None) -> torch.Tensor:
    n = flat.numel()
    if indices is None:
        k = _kept_count(n, fraction)
        return torch.topk(flat.float().abs(), k, sorted=False).indices.sort().values
    given = torch.as_tensor(indices).reshape(-1)
    if given.is_floating_point() or given.dtype == torch.bool:
        raise ValueError("indices must be integers (flat indices into the tensor)")
    given = given.to(torch.int64).sort().values
    if given.numel() and (given[0] < 0 or given[-1] >= n):
        raise ValueError(f"indices must be in [0, {n}) for a tensor of {n} elements")
    if given.numel() > 1 and not bool((given[1:] > given[:-1]).all()):
        raise ValueError("indices must be unique")
    return given


def _index_kind(numel: int, kept: int) -> int:
    """The smaller of int32 indices (4 bytes each) and a bitmap (1 bit per element); a bitmap on a tie."""
    if numel > _MAX_INT32 or -(-numel // 8) <= 4 * kept:
        return _INDEX_BITMAP
    return _INDEX_LIST


def _index_bytes(kept: torch.Tensor, numel: int) -> bytes:
    if _index_kind(numel, kept.numel()) == _INDEX_LIST:
        return kept.numpy().astype("<i4").tobytes()
    mask = np.zeros(numel, dtype=np.bool_)
    mask[kept.numpy()] = True
    return np.packbits(mask, bitorder="little").tobytes()


def _value_bytes(values: torch.Tensor, how: str) -> bytes:
    """``values`` (1-D) in one of ``VALUE_CODECS``."""
    if how == "none":
        return values.contiguous().view(torch.uint8).numpy().tobytes() if values.numel() else b""
    if how == "fp16":
        return values.float().clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16).view(torch.int16).numpy().tobytes()
    if how == "bf16":
        return values.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    scales, q = _int8(values.float())
    return scales.numpy().astype("<f4").tobytes() + q.numpy().tobytes()


def _int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax quantization: (one float32 scale per block, the int8 values)."""
    m = x.numel()
    blocks = -(-m // INT8_BLOCK)
    padded = torch.nn.functional.pad(x, (0, blocks * INT8_BLOCK - m)).view(blocks, INT8_BLOCK)
    finite = torch.isfinite(padded).all(dim=1)
    clean = padded.nan_to_num(0.0, 0.0, 0.0)
    scales = clean.abs().amax(dim=1) / 127
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = (clean / safe[:, None]).round().clamp(-127, 127).to(torch.int8).reshape(-1)[:m]
    return torch.where(finite, scales, torch.full_like(scales, math.nan)), q


# ---- sizes --------------------------------------------------------------------------------------------------
def _value_size(count: int, how: str, itemsize: int) -> int:
    if how == "none":
        return count * itemsize
    if how in ("fp16", "bf16"):
        return 2 * count
    return 4 * -(-count // INT8_BLOCK) + count


def payload_bytes(numel: int, dtype: torch.dtype, codec: Codec) -> int:
    """Bytes of the tensor's buffer on the wire (``len(encode(...).serialized.buffer)``, before sealing, which adds
    a constant; the message's shape and framing add a few bytes more)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if codec.name == "none":
        return numel * itemsize
    if codec.name != "topk":
        return HEADER.size + _value_size(numel, codec.name, itemsize)
    kept = _kept_count(numel, codec.fraction)
    index = -(-numel // 8) if _index_kind(numel, kept) == _INDEX_BITMAP else 4 * kept
    return HEADER.size + index + _value_size(kept, codec.values, itemsize)


# ---- decoding -----------------------------------------------------------------------------------------------
def decode(serialized: runtime_pb2.Tensor, *, max_bytes: int) -> Decoded:
    """The dense tensor of ``serialized`` (any codec); refused with ``ValueError("malformed ...")`` if any declared
    size, count or index does not add up, or the dense tensor would exceed ``max_bytes``, before allocating it."""
    dtype = FLOAT_DTYPES.get(serialized.dtype)
    if dtype is None:
        raise ValueError(f"malformed tensor: dtype {serialized.dtype[:32]!r} is not one of {list(FLOAT_DTYPES)}")
    if len(serialized.size) > MAX_DIMS or any(d < 0 for d in serialized.size):
        raise ValueError(f"malformed tensor: shape {list(serialized.size)[:MAX_DIMS + 1]} (at most {MAX_DIMS} "
                         "dimensions, none negative)")
    numel = math.prod(serialized.size)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if numel * itemsize > max_bytes:
        raise ValueError(f"malformed tensor: it declares {numel} elements ({numel * itemsize} bytes decoded), beyond "
                         f"the limit of {max_bytes} bytes; send smaller tensors")
    if serialized.compression == runtime_pb2.CompressionType.NONE:
        return Decoded(_decode_none(serialized, numel, itemsize))
    if serialized.compression != CODED:
        raise ValueError(f"malformed tensor: compression type {serialized.compression} is not accepted")
    return _decode_coded(serialized, dtype, numel, itemsize)


def _decode_none(serialized: runtime_pb2.Tensor, numel: int, itemsize: int) -> torch.Tensor:
    legacy = {numel * 4} if serialized.dtype == "bfloat16" else set()  # older hivemind sends bfloat16 as float32
    if len(serialized.buffer) not in {numel * itemsize, *legacy}:
        raise ValueError(f"malformed tensor: shape {tuple(serialized.size)} does not match its "
                         f"{len(serialized.buffer)} bytes")
    return deserialize_torch_tensor(serialized).detach()


def _decode_coded(serialized: runtime_pb2.Tensor, dtype: torch.dtype, numel: int, itemsize: int) -> Decoded:
    buffer = memoryview(serialized.buffer)
    if len(buffer) < HEADER.size:
        raise ValueError(f"malformed coded tensor: {len(buffer)} bytes, shorter than its {HEADER.size}-byte header")
    magic, codec_id, values_id, index_kind, reserved, kept = HEADER.unpack_from(buffer)
    names = {v: k for k, v in _CODEC_IDS.items()}
    value_names = {v: k for k, v in _VALUE_IDS.items()}
    if magic != MAGIC or reserved or codec_id not in names or values_id not in value_names:
        raise ValueError("malformed coded tensor: unknown header (magic, codec or values codec)")
    name, shape = names[codec_id], tuple(serialized.size)
    if name != "topk":
        if values_id or index_kind != _INDEX_NONE or kept:
            raise ValueError(f"malformed coded tensor: a {name} header with top-k fields")
        expected = HEADER.size + _value_size(numel, name, itemsize)
        _check_length(len(buffer), expected, shape, name)
        values = _values_from(buffer[HEADER.size:], numel, name, dtype)
        return Decoded(values.reshape(shape))
    how = value_names[values_id]
    if kept > numel or (numel and not kept) or index_kind != _index_kind(numel, kept):
        raise ValueError(f"malformed coded tensor: top-k of {kept} values (index kind {index_kind}) in a tensor of "
                         f"{numel} elements")
    index_size = -(-numel // 8) if index_kind == _INDEX_BITMAP else 4 * kept
    expected = HEADER.size + index_size + _value_size(kept, how, itemsize)
    _check_length(len(buffer), expected, shape, f"top-k ({kept} kept, values {how})")
    body = buffer[HEADER.size:]
    indices = _indices_from(body[:index_size], index_kind, numel, kept)
    values = _values_from(body[index_size:], kept, how, dtype)
    dense = torch.zeros(numel, dtype=dtype)
    dense[indices] = values
    return Decoded(dense.reshape(shape), indices)


def _check_length(actual: int, expected: int, shape: tuple, what: str) -> None:
    if actual != expected:
        raise ValueError(f"malformed coded tensor: {what} of shape {shape} takes {expected} bytes, got {actual}")


def _indices_from(data: memoryview, kind: int, numel: int, kept: int) -> torch.Tensor:
    if kind == _INDEX_LIST:
        found = np.frombuffer(data, dtype="<i4").astype(np.int64)
        if kept and (found[0] < 0 or found[-1] >= numel or (kept > 1 and not (np.diff(found) > 0).all())):
            raise ValueError(f"malformed coded tensor: top-k indices must be strictly increasing in [0, {numel})")
        return torch.from_numpy(found)
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
    if bits[numel:].any() or int(bits[:numel].sum()) != kept:
        raise ValueError(f"malformed coded tensor: the top-k bitmap does not mark exactly {kept} of {numel} elements")
    return torch.from_numpy(np.flatnonzero(bits[:numel]).astype(np.int64))


def _values_from(data: memoryview, count: int, how: str, dtype: torch.dtype) -> torch.Tensor:
    """``count`` values of ``dtype`` from their bytes in ``how`` (sizes checked by the caller)."""
    if count == 0:
        return torch.zeros(0, dtype=dtype)
    if how == "none":
        return torch.frombuffer(bytearray(data), dtype=dtype)
    if how in ("fp16", "bf16"):
        half = torch.float16 if how == "fp16" else torch.bfloat16
        return torch.frombuffer(bytearray(data), dtype=torch.int16).view(half).to(dtype)
    blocks = -(-count // INT8_BLOCK)
    scales = torch.from_numpy(np.frombuffer(data[: 4 * blocks], dtype="<f4").astype(np.float32))
    q = torch.from_numpy(np.frombuffer(data[4 * blocks :], dtype=np.int8).astype(np.float32))
    padded = torch.nn.functional.pad(q, (0, blocks * INT8_BLOCK - count)).view(blocks, INT8_BLOCK)
    return (padded * scales[:, None]).reshape(-1)[:count].to(dtype)
