"""Type checks of values unpacked from msgpack, for ``peers.wire.Message``: field types as annotated.

A field annotated ``int``, ``float``, ``bool``, ``str`` or ``bytes`` takes exactly that type (floats accept
ints; ints must fit in 64 bits, floats must be finite); ``list[T]`` is checked element by element; ``dict[str, Any]``
needs string keys and values nested at most ``MAX_NESTING`` deep (msgpack allows 1024 levels, deep enough that
``repr`` and ``==`` of the value raise ``RecursionError`` in whatever code handles it next).
"""

from __future__ import annotations

import math
from typing import Any, get_args, get_origin

import msgpack

MAX_NESTING = 16
MAX_MESSAGE_BYTES = 1 << 16  # ours are under 40 KiB (a step of 512 sessions); unpacking costs up to 0.5 us a byte
_INT64 = 1 << 63


class Mismatch(Exception):
    """Raised by :func:`conform`; the caller turns it into its own error with the field's name."""


def unpack_map(data: bytes, what: str) -> dict:
    """A msgpack map with string (or bytes) keys, of at most ``MAX_MESSAGE_BYTES``; ``ValueError`` naming ``what``
    for anything else (4 MiB of tiny nested lists took 2 s of the event loop to unpack)."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"malformed {what}: {len(data)} bytes of metadata, at most {MAX_MESSAGE_BYTES} accepted")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises ValueError, and TypeError for unhashable keys
        raise ValueError(f"malformed {what}: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"malformed {what}: expected a map")
    return raw


def conform(value: Any, expected: Any) -> Any:
    """``value`` checked against the annotation ``expected`` (converted: ints to float); ``Mismatch`` otherwise."""
    origin = get_origin(expected)
    if origin is list:
        if not isinstance(value, list):
            raise Mismatch
        (item,) = get_args(expected)
        return [conform(v, item) for v in value]
    if origin is dict:
        key = get_args(expected)[0]
        if not isinstance(value, dict) or not all(isinstance(k, key) for k in value) or not nested_within(value):
            raise Mismatch
        return value
    if expected is Any:
        return value
    if expected is float:
        if isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, float) or not math.isfinite(value):
            raise Mismatch
        return value
    if expected is int:
        if not isinstance(value, int) or isinstance(value, bool) or not -_INT64 <= value < _INT64:
            raise Mismatch
        return value
    if not isinstance(value, expected):
        raise Mismatch
    return value


def nested_within(value: Any, limit: int = MAX_NESTING) -> bool:
    """Whether lists and maps nest at most ``limit`` levels in ``value`` (checked level by level, no recursion)."""
    level = [value]
    for _ in range(limit + 1):
        level = [v for x in level if isinstance(x, (list, tuple, dict))
                 for v in (x.values() if isinstance(x, dict) else x)]
        if not level:
            return True
    return False


def type_name(expected: Any) -> str:
    """How an error message names an annotation: ``int``, ``list[str]``, ``dict[str, Any]``."""
    if get_origin(expected) is not None:
        return str(expected).replace("typing.", "")
    return {float: "float (finite)", int: "int (64-bit)"}.get(expected, expected.__name__)
