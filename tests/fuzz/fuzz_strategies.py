"""Hypothesis strategies shared by the fuzz tests: msgpack values, maps shaped like a schema, mutated bytes."""

from __future__ import annotations

from typing import Any

import msgpack
from hypothesis import strategies as st

# every msgpack scalar, at its edges: ints from int64's minimum to uint64's maximum, NaN and infinities, str vs bytes
INTS = st.one_of(st.integers(-(1 << 63), (1 << 64) - 1), st.sampled_from([0, 1, -1, (1 << 63) - 1, 1 << 63,
                                                                            (1 << 64) - 1, -(1 << 63)]))
SCALARS = st.one_of(st.none(), st.booleans(), INTS, st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=20), st.binary(max_size=20))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8) | st.binary(max_size=4), inner, max_size=4),
                      max_leaves=12)


class Deep:
    """A value nested 1000 levels deep: msgpack reads it (its limit is 1024), but its repr and == recurse past
    Python's limit; msgpack cannot write it, so ``pack`` splices its bytes in."""

    RAW = (b"\x91" * 1000 + b"\xc0", b"\x81\xa1k" * 1000 + b"\xc0")  # [[[...]]] and {"k": {"k": ...}}

    def __init__(self, kind: int) -> None:
        self.kind = kind

    def __repr__(self) -> str:
        return f"Deep({self.kind})"


DEEP = st.sampled_from([Deep(0), Deep(1)])


def pack(value: Any) -> bytes:
    """msgpack of ``value``, with every ``Deep`` in it replaced by its raw bytes."""
    marks = {}

    def default(obj: Any) -> Any:
        if not isinstance(obj, Deep):
            raise TypeError(f"cannot pack {obj!r}")
        marks[obj.kind] = msgpack.packb(msgpack.ExtType(99, b"deep-%d" % obj.kind))
        return msgpack.ExtType(99, b"deep-%d" % obj.kind)

    data = msgpack.packb(value, use_bin_type=True, default=default)
    for kind, mark in marks.items():
        data = data.replace(mark, Deep.RAW[kind])
    return data


def shaped_maps(fields: dict[str, st.SearchStrategy], extra: st.SearchStrategy = VALUES) -> st.SearchStrategy:
    """Maps that have some of ``fields`` (each well-typed or any value), plus maybe an unknown key."""
    return st.fixed_dictionaries({}, optional={name: strategy | extra | DEEP
                                               for name, strategy in fields.items()}) \
        .flatmap(lambda d: st.dictionaries(st.text(max_size=6), extra, max_size=1).map(lambda x: {**x, **d}))


@st.composite
def mutated(draw, original: bytes) -> bytes:
    """``original`` truncated, extended, or with a few bytes flipped or replaced."""
    data = bytearray(original)
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["flip", "set", "cut", "append", "insert"]))
        where = draw(st.integers(0, max(0, len(data) - 1)))
        if how == "flip" and data:
            data[where] ^= 1 << draw(st.integers(0, 7))
        elif how == "set" and data:
            data[where] = draw(st.integers(0, 255))
        elif how == "cut":
            data = data[:where]
        elif how == "append":
            data += draw(st.binary(min_size=1, max_size=8))
        else:
            data[where:where] = draw(st.binary(min_size=1, max_size=4))
    return bytes(data)
