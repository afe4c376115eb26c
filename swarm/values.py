"""Checks of values read from the DHT (records, plans): untrusted, unpacked from msgpack."""

from __future__ import annotations

import math
from typing import Any


def shown(value: Any) -> str:
    """A short repr for an error message: an untrusted nested list's repr may be huge or exceed the recursion limit."""
    if isinstance(value, (str, bytes, int, float, type(None))):
        return repr(value[:64] if isinstance(value, (str, bytes)) else value)
    return f"of type {type(value).__name__}"


def is_int(value: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
