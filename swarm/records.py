"""Typed records that peers publish in the DHT. Everything that crosses the DHT is one of these."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from swarm.values import is_int, is_number, shown

WIRE_VERSION = 1
_PEER_ID_RE = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{20,80}$")  # base58 libp2p peer id
_DTYPES = ("float32", "float16", "bfloat16")
_MAX_TEXT = 256
MAX_LINKS = 8  # rows of a record's link table
MAX_BANDWIDTH = 1e13  # bits/s: 10 Tbit/s, beyond any link
MAX_RTT = 600.0  # seconds
MAX_AGE = 1e7  # seconds (~4 months)
MAX_BLOCKS = 100_000  # blocks of a model
MAX_CACHE_TOKENS = 1 << 40  # a record's cache figures
MAX_SECONDS_PER_TOKEN = 3600.0  # compute of one token through one block
LINK_SOURCES = ("passive", "probe")
DEFAULT_SECONDS_PER_BLOCK = 0.01  # a record with neither compute nor throughput: a slow CPU (100 tokens/s per block)
BACKWARD_RATIO = 2.0  # backward / forward compute when the backward was not measured (the usual ~2x)


@dataclass(frozen=True)
class LinkRow:
    """One row of a record's table of best-known links: to neighbour ``peer_id``, its ``bandwidth`` in bits/s (0:
    only the round trip is known), round trip ``rtt`` in seconds (network time only), ``age`` in seconds at the
    announcement, and ``source``: "passive" (real traffic) or "probe" (an active probe)."""

    peer_id: str
    bandwidth: float
    rtt: float
    age: float
    source: str = "passive"

    def __post_init__(self) -> None:
        _check(isinstance(self.peer_id, str) and _PEER_ID_RE.fullmatch(self.peer_id),
               f"bad link peer_id {shown(self.peer_id)}")
        for name, most in (("bandwidth", MAX_BANDWIDTH), ("rtt", MAX_RTT), ("age", MAX_AGE)):
            value = getattr(self, name)
            _check(is_number(value) and 0 <= value <= most, f"bad link {name} {shown(value)} (0..{most:g})")
        _check(isinstance(self.source, str) and self.source in LINK_SOURCES, f"bad link source {shown(self.source)}")

    def to_wire(self) -> dict[str, Any]:
        return {"peer": self.peer_id, "bw": self.bandwidth, "rtt": self.rtt, "age": self.age, "src": self.source}

    @classmethod
    def from_wire(cls, wire: Any) -> LinkRow:
        """A row as a record carries it (unknown keys ignored); ``ValueError`` if malformed."""
        if not isinstance(wire, dict):
            raise ValueError(f"invalid PeerRecord: a link must be a dict, got {type(wire).__name__}")
        missing = {"peer", "bw", "rtt", "age"} - wire.keys()
        if missing:
            raise ValueError(f"invalid PeerRecord: a link lacks {sorted(missing)}")
        return cls(peer_id=wire["peer"], bandwidth=wire["bw"], rtt=wire["rtt"], age=wire["age"],
                   source=wire.get("src", "passive"))


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
    throughput: float  # measured tokens/s through ONE block on this peer's device (compute only; older readers)
    device: str = "cpu"
    dtype: str = "float32"
    public_name: str = ""
    version: str = ""
    addresses: tuple[str, ...] = field(default_factory=tuple)  # multiaddrs others may dial
    max_batch_size: int = 1
    wire: int = WIRE_VERSION
    # measured compute, seconds per token per block (a 128-token forward; backward of the same); 0: not measured
    forward_seconds: float = 0.0
    backward_seconds: float = 0.0
    links: tuple[LinkRow, ...] = field(default_factory=tuple)  # best-known links, at most MAX_LINKS
    max_blocks: int = 0  # how many blocks its memory holds (the planner's bound); 0: unknown (its span's size)
    # its inference KV cache at the announcement, in tokens (batch rows x max length): budget and reserved; 0: unknown
    cache_tokens: int = 0
    cache_used: int = 0

    def __post_init__(self) -> None:
        peer_id_ok = isinstance(self.peer_id, str) and _PEER_ID_RE.fullmatch(self.peer_id)
        _check(peer_id_ok, f"bad peer_id {shown(self.peer_id)}")
        _check(isinstance(self.model, str) and 0 < len(self.model) <= _MAX_TEXT, "bad model name")
        _check(is_int(self.start) and is_int(self.end), "start/end must be integers")
        _check(0 <= self.start < self.end, f"bad block range {self.start}:{self.end}")
        _check(isinstance(self.state, PeerState), f"bad state {shown(self.state)}")
        _check(is_number(self.throughput) and self.throughput >= 0, f"bad throughput {shown(self.throughput)}")
        _check(isinstance(self.dtype, str) and self.dtype in _DTYPES, f"bad dtype {shown(self.dtype)}")
        for name in ("device", "public_name", "version"):
            value = getattr(self, name)
            _check(isinstance(value, str) and len(value) <= _MAX_TEXT, f"bad {name}")
        _check(
            isinstance(self.addresses, tuple) and all(isinstance(a, str) for a in self.addresses),
            "addresses must be strings",
        )
        _check(is_int(self.max_batch_size) and self.max_batch_size >= 1, "bad max_batch_size")
        _check(is_int(self.max_blocks) and 0 <= self.max_blocks <= MAX_BLOCKS,
               f"bad max_blocks {shown(self.max_blocks)}")
        for name in ("cache_tokens", "cache_used"):
            value = getattr(self, name)
            _check(is_int(value) and 0 <= value <= MAX_CACHE_TOKENS, f"bad {name} {shown(value)}")
        _check(is_int(self.wire), "wire must be an integer")  # else the record would not even hash
        for name in ("forward_seconds", "backward_seconds"):
            value = getattr(self, name)
            _check(is_number(value) and 0 <= value <= MAX_SECONDS_PER_TOKEN,
                   f"bad {name} {shown(value)} (0..{MAX_SECONDS_PER_TOKEN:g})")
        _check(isinstance(self.links, tuple) and len(self.links) <= MAX_LINKS
               and all(isinstance(row, LinkRow) for row in self.links),
               f"links must be a tuple of at most {MAX_LINKS} LinkRow")
        _check(len({row.peer_id for row in self.links}) == len(self.links), "links name a neighbour twice")

    @property
    def num_blocks(self) -> int:
        return self.end - self.start

    @property
    def span(self) -> str:
        return f"{self.start}:{self.end}"

    @property
    def capacity(self) -> int:
        """Blocks this peer can hold: its announced ``max_blocks``, else (unknown) the span it serves."""
        return max(self.max_blocks, self.num_blocks)

    @property
    def seconds_per_block(self) -> float:
        """Forward compute of one token through one block: measured, else from ``throughput`` (older peers), else
        ``DEFAULT_SECONDS_PER_BLOCK`` (a conservative guess: a slow CPU)."""
        if self.forward_seconds > 0:
            return self.forward_seconds
        return 1.0 / self.throughput if self.throughput > 0 else DEFAULT_SECONDS_PER_BLOCK

    @property
    def backward_seconds_per_block(self) -> float:
        """Backward compute of one token through one block: measured, else ``BACKWARD_RATIO`` x the forward."""
        return self.backward_seconds if self.backward_seconds > 0 else BACKWARD_RATIO * self.seconds_per_block

    def to_wire(self) -> dict[str, Any]:
        """A msgpack-friendly dict."""
        wire = asdict(self)
        wire["state"] = self.state.value
        wire["addresses"] = list(self.addresses)
        wire["links"] = [row.to_wire() for row in self.links]
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
            raise ValueError(f"bad state {shown(kwargs['state'])}") from None
        if not isinstance(kwargs.get("addresses", ()), (list, tuple)):  # tuple("/ip4/...") would split a string
            raise ValueError(f"addresses must be a list of strings, got {type(kwargs['addresses']).__name__}")
        kwargs["addresses"] = tuple(kwargs.get("addresses", ()))
        links = kwargs.get("links", ())
        if not isinstance(links, (list, tuple)):
            raise ValueError(f"invalid PeerRecord: links must be a list, got {type(links).__name__}")
        if len(links) > MAX_LINKS:  # checked before parsing: an attacker's 10^6 rows cost nothing
            raise ValueError(f"invalid PeerRecord: {len(links)} links, at most {MAX_LINKS}")
        kwargs["links"] = tuple(LinkRow.from_wire(row) for row in links)
        return cls(**kwargs)


def _check(ok: Any, message: str) -> None:
    if not ok:
        raise ValueError(f"invalid PeerRecord: {message}")
