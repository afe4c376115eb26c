"""The codecs of ``swarm.compression``: round trips within each codec's stated bound, top-k's patterns, exact payload
sizes, and crafted messages refused before anything large is allocated."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
from hivemind.proto import runtime_pb2

from peers.wire.tensors import serialize
from swarm.compression import NONE, Codec, decode, encode, payload_bytes
from swarm.compression.codecs import CODED, HEADER, INT8_BLOCK, MAGIC

LIMIT = 1 << 30
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SHAPES = ((3, 1000), (1, 7, 33), (1,), (129,), (2, 0, 5), ())
TEXTS = ("none", "fp16", "bf16", "int8", "topk:0.1", "topk:0.25/fp16", "topk:0.5/bf16", "topk:0.01/int8",
         "topk:1.0/int8")


def round_trip(x: torch.Tensor, codec: Codec, **kwargs):
    encoded = encode(x, codec, **kwargs)
    return encoded, decode(encoded.serialized, max_bytes=LIMIT)


def tensor(shape: tuple, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * torch.logspace(-3, 3, max(1, shape[-1] if shape else 1))[
        : (shape[-1] if shape else 1)]).reshape(shape).to(dtype)


# ---- the codec's text -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", TEXTS)
def test_text_round_trips(text):
    codec = Codec.parse(text)
    assert Codec.parse(str(codec)) == codec
    assert str(codec) == text


@pytest.mark.parametrize("text", ["fp8", "topk", "topk:0", "topk:1.5", "topk:-0.1", "topk:nan", "topk:x",
                                  "topk:0.1/fp8", "topk0.1", ""])
def test_bad_text_is_refused(text):
    with pytest.raises(ValueError):
        Codec.parse(text)


def test_only_topk_takes_a_fraction():
    with pytest.raises(ValueError):
        Codec("fp16", fraction=0.5)
    with pytest.raises(ValueError):
        Codec("int8", values="fp16")


# ---- round trips within the stated bounds -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_none_is_bit_exact_and_todays_wire(dtype, shape):
    x = tensor(shape, dtype)
    encoded, decoded = round_trip(x, NONE)
    assert encoded.serialized.SerializeToString() == serialize(x).SerializeToString()
    assert decoded.tensor.dtype == dtype and torch.equal(decoded.tensor, x) and decoded.indices is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fp16_relative_error(dtype, shape):
    x = tensor(shape, dtype)
    _, decoded = round_trip(x, Codec("fp16"))
    got, want = decoded.tensor, x.float()
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float16:
        assert torch.equal(got, x)
        return
    bound = want.abs() * 2.0**-11 + 2.0**-25  # normal range relative, absolute below it
    if dtype == torch.bfloat16:
        bound = bound + want.abs() * 2.0**-8  # the decoded value is rounded into bfloat16
    assert bool(((got.float() - want).abs() <= bound).all())


def test_fp16_clamps_out_of_range_and_keeps_nan():
    x = torch.tensor([1e6, -1e6, float("inf"), float("nan"), 1.0])
    _, decoded = round_trip(x, Codec("fp16"))
    assert decoded.tensor[:3].tolist() == [65504.0, -65504.0, 65504.0]
    assert decoded.tensor[3].isnan() and decoded.tensor[4] == 1.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_relative_error(dtype, shape):
    x = tensor(shape, dtype)
    _, decoded = round_trip(x, Codec("bf16"))
    got, want = decoded.tensor.float(), x.float()
    if dtype == torch.bfloat16:
        assert torch.equal(decoded.tensor, x)
        return
    bound = want.abs() * 2.0**-8 + 1e-38
    if dtype == torch.float16:
        bound = bound + want.abs() * 2.0**-11 + 2.0**-25
    assert bool(((got - want).abs() <= bound).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_int8_blockwise_error(dtype, shape):
    x = tensor(shape, dtype)
    _, decoded = round_trip(x, Codec("int8"))
    got, want = decoded.tensor.float().reshape(-1), x.float().reshape(-1)
    assert decoded.tensor.dtype == dtype and decoded.tensor.shape == x.shape
    for start in range(0, want.numel(), INT8_BLOCK):
        block, back = want[start : start + INT8_BLOCK], got[start : start + INT8_BLOCK]
        bound = block.abs().max() / 254 * (1 + 1e-5)
        if dtype != torch.float32:  # rounded into the original dtype after dequantizing
            bound = bound + block.abs() * (2.0**-8 if dtype == torch.bfloat16 else 2.0**-11)
        assert bool(((back - block).abs() <= bound).all()), start


def test_int8_non_finite_block_decodes_to_nan_others_intact():
    x = torch.randn(3 * INT8_BLOCK)
    x[INT8_BLOCK + 5] = float("inf")
    _, decoded = round_trip(x, Codec("int8"))
    assert decoded.tensor[INT8_BLOCK : 2 * INT8_BLOCK].isnan().all()
    assert torch.isfinite(decoded.tensor[:INT8_BLOCK]).all() and torch.isfinite(decoded.tensor[2 * INT8_BLOCK :]).all()


def test_int8_zero_block_stays_zero():
    _, decoded = round_trip(torch.zeros(300), Codec("int8"))
    assert torch.equal(decoded.tensor, torch.zeros(300))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fraction", [0.01, 0.1, 0.3, 1.0])
def test_topk_keeps_the_largest_magnitudes(dtype, fraction):
    x = tensor((4, 257), dtype, seed=3)
    encoded, decoded = round_trip(x, Codec("topk", fraction))
    flat = x.reshape(-1).float()
    k = math.ceil(fraction * flat.numel() - 1e-9)
    assert decoded.indices is not None and torch.equal(decoded.indices, encoded.indices)
    assert decoded.indices.numel() == k and bool((decoded.indices[1:] > decoded.indices[:-1]).all())
    kept = torch.zeros(flat.numel(), dtype=torch.bool)
    kept[decoded.indices] = True
    assert flat[kept].abs().min() >= torch.cat([flat[~kept].abs(), torch.zeros(1)]).max()
    dense = decoded.tensor.reshape(-1)
    assert torch.equal(dense[kept], x.reshape(-1)[kept]) and not dense[~kept].any()  # values "none": exact


@pytest.mark.parametrize("values", ["fp16", "bf16", "int8"])
def test_topk_values_within_their_codec_bound(values):
    x = tensor((2, 500), torch.float32, seed=5)
    _, decoded = round_trip(x, Codec("topk", 0.2, values))
    _, plain = round_trip(x.reshape(-1)[decoded.indices], Codec(values))
    assert torch.equal(decoded.tensor.reshape(-1)[decoded.indices], plain.tensor)


def test_topk_with_given_indices_keeps_exactly_that_pattern():
    x = torch.randn(3, 50)
    forward, _ = round_trip(x, Codec("topk", 0.1))
    grad = torch.randn(3, 50)
    encoded, decoded = round_trip(grad, Codec("topk", 0.9, "fp16"), indices=forward.indices.flip(0))
    assert torch.equal(decoded.indices, forward.indices) and torch.equal(encoded.indices, forward.indices)
    dense = decoded.tensor.reshape(-1)
    mask = torch.zeros(150, dtype=torch.bool)
    mask[forward.indices] = True
    assert not dense[~mask].any()
    assert torch.allclose(dense[mask], grad.reshape(-1)[mask], rtol=2**-10)


@pytest.mark.parametrize("bad", [torch.tensor([0, 150]), torch.tensor([-1]), torch.tensor([3, 3]),
                                 torch.tensor([0.5])])
def test_topk_refuses_bad_given_indices(bad):
    with pytest.raises(ValueError):
        encode(torch.randn(3, 50), Codec("topk", 0.1), indices=bad)


def test_indices_only_for_topk_and_codecs_only_for_floats():
    with pytest.raises(ValueError, match="topk"):
        encode(torch.randn(4), Codec("fp16"), indices=torch.tensor([1]))
    with pytest.raises(ValueError, match="float"):
        encode(torch.arange(4), Codec("int8"))


def test_topk_index_set_takes_the_cheaper_form():
    sparse, _ = round_trip(torch.randn(10_000), Codec("topk", 0.001))  # 10 indices: 40 B, a bitmap 1250 B
    dense, _ = round_trip(torch.randn(10_000), Codec("topk", 0.5))
    assert sparse.serialized.buffer[6] == 1 and dense.serialized.buffer[6] == 2  # index kind in the header
    assert len(sparse.serialized.buffer) == HEADER.size + 40 + 40


# ---- payload sizes ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", TEXTS + ("topk:0.001", "topk:0.03/int8"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [0, 1, 7, 127, 128, 129, 1000, 4096, 10_001])
def test_payload_bytes_is_what_encode_produces(text, dtype, numel):
    codec = Codec.parse(text)
    x = torch.randn(numel).to(dtype)
    assert payload_bytes(numel, dtype, codec) == len(encode(x, codec).serialized.buffer)


def test_lossy_codecs_save_bytes():
    n = 4096 * 16
    sizes = {text: payload_bytes(n, torch.float32, Codec.parse(text)) for text in TEXTS}
    assert sizes["none"] == 4 * n
    assert sizes["fp16"] < 0.51 * sizes["none"] and sizes["int8"] < 0.27 * sizes["none"]
    assert sizes["topk:0.01/int8"] < 0.02 * sizes["none"]


# ---- crafted messages ---------------------------------------------------------------------------------------------
def coded(size, buffer: bytes, dtype: str = "float32") -> runtime_pb2.Tensor:
    return runtime_pb2.Tensor(compression=CODED, size=size, dtype=dtype, buffer=buffer)


def header(codec: int, values: int = 0, index: int = 0, kept: int = 0, magic: bytes = MAGIC) -> bytes:
    return HEADER.pack(magic, codec, values, index, 0, kept)


@pytest.mark.parametrize("message", [
    coded([4], b"\x00" * 3),  # shorter than the header
    coded([4], header(1, magic=b"XXXX") + b"\x00" * 8),  # wrong magic
    coded([4], header(9) + b"\x00" * 8),  # unknown codec
    coded([4], header(4, values=7, index=1, kept=1) + b"\x00" * 8),  # unknown values codec
    coded([4], header(1) + b"\x00" * 7),  # fp16: one byte short
    coded([4], header(1) + b"\x00" * 9),  # fp16: one byte too many
    coded([4], header(1, values=1) + b"\x00" * 8),  # a dense codec with top-k fields
    coded([4], header(3) + b"\x00" * 4),  # int8: scale missing
    coded([100], header(4, 0, 2, kept=101) + b"\x00" * 13 + b"\x00" * 404),  # more kept than elements
    coded([100], header(4, 0, 2, kept=0) + b"\x00" * 13),  # nothing kept
    coded([100], header(4, 0, 2, kept=1) + b"\x00" * 13 + b"\x00" * 4),  # bitmap marks none of the 1
    coded([100], header(4, 0, 1, kept=1) + b"\x00" * 13 + b"\x00" * 4),  # index kind not the cheaper one
    coded([10_000], header(4, 0, 1, kept=2) + struct.pack("<2i", 5, 10_000) + b"\x00" * 8),  # index out of range
    coded([10_000], header(4, 0, 1, kept=2) + struct.pack("<2i", -1, 5) + b"\x00" * 8),  # negative index
    coded([10_000], header(4, 0, 1, kept=2) + struct.pack("<2i", 7, 7) + b"\x00" * 8),  # repeated index
    coded([10_000], header(4, 0, 1, kept=2) + struct.pack("<2i", 9, 7) + b"\x00" * 8),  # unsorted
    coded([4], header(1) + b"\x00" * 8, dtype="int64"),  # not a float dtype
    coded([1] * 9, header(1) + b"\x00" * 2),  # too many dimensions
    runtime_pb2.Tensor(compression=runtime_pb2.CompressionType.FLOAT16, size=[4], dtype="float32", buffer=b"\0" * 8),
    runtime_pb2.Tensor(size=[4], dtype="float32", buffer=b"\0" * 12),  # none: size mismatch
])
def test_malformed_messages_are_refused(message):
    with pytest.raises(ValueError, match="malformed"):
        decode(message, max_bytes=LIMIT)


def test_bitmap_padding_bits_are_refused():
    good = encode(torch.randn(10), Codec("topk", 0.5)).serialized
    buffer = bytearray(good.buffer)
    buffer[HEADER.size + 1] |= 0x80  # element 15 of a 10-element tensor
    with pytest.raises(ValueError, match="malformed"):
        decode(coded([10], bytes(buffer)), max_bytes=LIMIT)


@pytest.mark.parametrize("size", [[(1 << 32) - 1], [10**6, 10**6], [(1 << 32) - 1] * 8])
def test_huge_declared_tensor_is_refused_before_allocating(size):
    """A few bytes of top-k (one index) must not make a peer allocate a dense tensor of 10^12 elements or more."""
    message = coded(size, header(4, 0, 1, kept=1) + struct.pack("<i", 3) + b"\x00" * 4)
    with pytest.raises(ValueError, match="malformed.*limit"):
        decode(message, max_bytes=64 << 20)


def test_decoded_size_limit_applies_to_every_codec():
    x = torch.randn(1000)
    for text in TEXTS:
        serialized = encode(x, Codec.parse(text)).serialized
        assert decode(serialized, max_bytes=4000).tensor.shape == (1000,)
        with pytest.raises(ValueError, match="limit"):
            decode(serialized, max_bytes=3999)


def test_random_garbage_never_crashes():
    """Random headers and bodies give a tensor or ValueError, nothing else."""
    rng = np.random.default_rng(0)
    for _ in range(2000):
        codec = int(rng.integers(0, 6))
        body = rng.integers(0, 256, int(rng.integers(0, 64)), dtype=np.uint8).tobytes()
        head = HEADER.pack(MAGIC, codec, int(rng.integers(0, 5)), int(rng.integers(0, 4)), 0, int(rng.integers(0, 40)))
        size = [int(s) for s in rng.integers(0, 12, int(rng.integers(0, 3)))]
        try:
            dtype = str(rng.choice(["float32", "bfloat16", "float16"]))
            decode(coded(size, head + body, dtype=dtype), max_bytes=1 << 20)
        except ValueError as e:
            assert "malformed" in str(e)
