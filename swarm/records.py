"""Typed records that peers publish in the DHT. Everything that crosses the DHT is one of these."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

WIRE_VERSION = 1
_PEER_ID_RE = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{20,80}$")  # base58 libp2p peer id
_DTYPES = ("float32", "float16", "bfloat16")
_MAX_TEXT = 256


class PeerState(str, Enum):
    """Lifecycle of a peer as others see it."""

    JOINING = "joining"  # loading blocks or measuring; not yet serving
    ONLINE = "online"  # serving its blocks
    BACKUP = "backup"  # idle, ready to take over blocks of a peer that leaves
    OFFLINE = "offline"  # announced just before a clean shutdown


@dataclass(frozen=True)
class PeerRecord:
    """What one peer announces about itself under its model's DHT key."""

    peer_id: str  # base58 libp2p peer id
    model: str  # model name (the DHT key prefix)
    start: int  # first block served
    end: int  # one past the last block served
    state: PeerState
    throughput: float  # measured tokens/s through ONE block on this peer's device (compute only)
    device: str = "cpu"
    dtype: str = "float32"
    public_name: str = ""
    version: str = ""
    addresses: tuple[str, ...] = field(default_factory=tuple)  # multiaddrs others may dial
    max_batch_size: int = 1
    wire: int = WIRE_VERSION

    def __post_init__(self) -> None:
        peer_id_ok = isinstance(self.peer_id, str) and _PEER_ID_RE.fullmatch(self.peer_id)
        _check(peer_id_ok, f"bad peer_id {_shown(self.peer_id)}")
        _check(isinstance(self.model, str) and 0 < len(self.model) <= _MAX_TEXT, "bad model name")
        _check(_is_int(self.start) and _is_int(self.end), "start/end must be integers")
        _check(0 <= self.start < self.end, f"bad block range {self.start}:{self.end}")
        _check(isinstance(self.state, PeerState), f"bad state {_shown(self.state)}")
        _check(_is_number(self.throughput) and self.throughput >= 0, f"bad throughput {_shown(self.throughput)}")
        _check(isinstance(self.dtype, str) and self.dtype in _DTYPES, f"bad dtype {_shown(self.dtype)}")
        for name in ("device", "public_name", "version"):
            value = getattr(self, name)
            _check(isinstance(value, str) and len(value) <= _MAX_TEXT, f"bad {name}")
        _check(
            isinstance(self.addresses, tuple) and all(isinstance(a, str) for a in self.addresses),
            "addresses must be strings",
        )
        _check(_is_int(self.max_batch_size) and self.max_batch_size >= 1, "bad max_batch_size")
        _check(_is_int(self.wire), "wire must be an integer")  # else the record would not even hash

    @property
    def num_blocks(self) -> int:
        return self.end - self.start

    @property
    def span(self) -> str:
        return f"{self.start}:{self.end}"

    def to_wire(self) -> dict[str, Any]:
        """A msgpack-friendly dict."""
        wire = asdict(self)
        wire["state"] = self.state.value
        wire["addresses"] = list(self.addresses)
        return wire

    @classmethod
    def from_wire(cls, wire: Any) -> PeerRecord:
        """Parse a record received from the DHT (any value hivemind's msgpack yields); ``ValueError`` if malformed."""
        if not isinstance(wire, dict):
            raise ValueError(f"record must be a dict, got {type(wire).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        missing = {"peer_id", "model", "start", "end", "state", "throughput"} - wire.keys()
        if missing:
            raise ValueError(f"record lacks {sorted(missing)}")
        kwargs = {k: v for k, v in wire.items() if k in known}  # unknown fields: newer peers, ignored
        try:
            if not isinstance(kwargs["state"], str):  # an Enum's own error would repr the value, whatever it is
                raise ValueError
            kwargs["state"] = PeerState(kwargs["state"])
        except ValueError:
            raise ValueError(f"bad state {_shown(kwargs['state'])}") from None
        if not isinstance(kwargs.get("addresses", ()), (list, tuple)):  # tuple("/ip4/...") would split a string
            raise ValueError(f"addresses must be a list of strings, got {type(kwargs['addresses']).__name__}")
        kwargs["addresses"] = tuple(kwargs.get("addresses", ()))
        return cls(**kwargs)


def _shown(value: Any) -> str:
    """A short repr for an error message: an untrusted nested list's repr may be huge or exceed the recursion limit."""
    if isinstance(value, (str, bytes, int, float, type(None))):
        return repr(value[:64] if isinstance(value, (str, bytes)) else value)
    return f"of type {type(value).__name__}"


def _check(ok: Any, message: str) -> None:
    if not ok:
        raise ValueError(f"invalid PeerRecord: {message}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
