"""What the estimator is told: the model's shape, each stage's measured compute, the links, the stream's costs.

Every figure is in seconds, bytes or bits/s. Nothing here is fitted on the runs the estimator is checked against:
compute comes from each peer's own measurement (its record, or measured the same way), links from the swarm's
link table (or a testbed's configured rates), and the stream's per-message costs from a measurement on 127.0.0.1
(``benchmarks/estimator.py`` prints it; ``LOOPBACK_STREAM`` below is one such measurement).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

CLIENT = "client"  # the client's (or trainer's) name in ``Pipeline.links``
Topology = Literal["star", "chain"]
TOPOLOGIES = ("star", "chain")

# IP packets on an Ethernet-framed path carry 1448 bytes of TCP payload in 1514 bytes (14 Ethernet + 20 IP + 32 TCP
# with timestamps) at a 1500-byte MTU; a shaper counts the whole frame, so payload moves at 1448/1514 of its rate.
TCP_PAYLOAD_FRACTION = 1448 / 1514


def _positive(name: str, value: float, *, zero: bool = True) -> None:
    ok = isinstance(value, (int, float)) and math.isfinite(value) and (value >= 0 if zero else value > 0)
    if not ok:
        raise ValueError(f"{name} must be a finite number {'>= 0' if zero else '> 0'}, got {value!r}")


@dataclass(frozen=True)
class ModelShape:
    """What the costs need of the model: the hidden size, how many blocks, and the bytes of one activation."""

    hidden_size: int
    num_blocks: int
    dtype_bytes: int = 4  # float32; 2 for float16/bfloat16 (what travels on the wire)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_blocks", "dtype_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelShape.{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class Compute:
    """A peer's measured compute per block: ``fixed + tokens * per_token`` seconds for each block a call runs."""

    forward_s: float  # seconds per token per block, forward (inference and training)
    backward_s: float = 0.0  # seconds per token per block, backward (with keep_activations: no recompute)
    forward_fixed_s: float = 0.0  # seconds per block per call, whatever the tokens (small ops, Python)
    backward_fixed_s: float = 0.0
    apply_s: float = 0.0  # seconds per block of one optimizer step (the commit of a training step)
    call_s: float = 0.0  # seconds per call on this peer besides its blocks (checks, handler)

    def __post_init__(self) -> None:
        for name in ("forward_s", "backward_s", "forward_fixed_s", "backward_fixed_s", "apply_s", "call_s"):
            _positive(f"Compute.{name}", getattr(self, name))

    def forward(self, tokens: int, blocks: int) -> float:
        return self.call_s + blocks * (self.forward_fixed_s + tokens * self.forward_s)

    def backward(self, tokens: int, blocks: int, recompute: bool = False) -> float:
        """A backward call; ``recompute``: the stage runs the forward again first (stateless stages)."""
        again = blocks * (self.forward_fixed_s + tokens * self.forward_s) if recompute else 0.0
        return self.call_s + again + blocks * (self.backward_fixed_s + tokens * self.backward_s)


@dataclass(frozen=True)
class ClientCompute:
    """The client's own part (embedding, head, loss, sampling), measured on the client: ``fixed + tokens * s``."""

    forward_s: float = 0.0  # seconds per token: embedding + head (+ sampling / loss)
    backward_s: float = 0.0  # seconds per token: the head's and the embedding's backward (training)
    fixed_s: float = 0.0  # seconds per step (inference) or micro-batch (training)
    apply_s: float = 0.0  # seconds of the client's own optimizer step, per training step

    def __post_init__(self) -> None:
        for name in ("forward_s", "backward_s", "fixed_s", "apply_s"):
            _positive(f"ClientCompute.{name}", getattr(self, name))


@dataclass(frozen=True)
class Codec:
    """How a tensor is encoded on a link: ``bytes_per_element`` (None: the dtype's), or ``size(elements)`` in bytes
    (top-k: values and indices; 8-bit: codes and scales), plus its CPU time at each end."""

    name: str = "none"
    bytes_per_element: float | None = None
    size: Callable[[int], float] | None = field(default=None, compare=False)
    cpu_s_per_element: float = 0.0  # encode at the sender plus decode at the receiver, per element

    def __post_init__(self) -> None:
        if self.bytes_per_element is not None:
            _positive("Codec.bytes_per_element", self.bytes_per_element, zero=False)
        _positive("Codec.cpu_s_per_element", self.cpu_s_per_element)

    def encoded_bytes(self, elements: int, dtype_bytes: int) -> float:
        if self.size is not None:
            value = float(self.size(elements))
            _positive(f"codec {self.name}'s size({elements})", value)
            return value
        return elements * (dtype_bytes if self.bytes_per_element is None else self.bytes_per_element)


NO_CODEC = Codec()


@dataclass(frozen=True)
class Link:
    """One direction between two hosts: ``bandwidth`` in bits/s (what a shaper or an ISP counts: whole frames),
    one-way ``latency`` in seconds. Links with the same ``shared`` name queue on one another (e.g. a home
    host's uplink to every peer); ``codec`` overrides the pipeline's codec for this direction."""

    bandwidth: float
    latency: float = 0.0
    shared: str | None = None
    codec: Codec | None = None

    def __post_init__(self) -> None:
        _positive("Link.bandwidth", self.bandwidth, zero=False)
        _positive("Link.latency", self.latency)

    @classmethod
    def from_rtt(cls, bandwidth: float, rtt: float, **kwargs) -> Link:
        """A link whose measured round trip (network only) is ``rtt``: half of it each way."""
        _positive("rtt", rtt)
        return cls(bandwidth, rtt / 2, **kwargs)

    @property
    def payload_rate(self) -> float:
        """Bytes/s of TCP payload the link carries."""
        return self.bandwidth / 8 * TCP_PAYLOAD_FRACTION


@dataclass(frozen=True)
class StreamCost:
    """What one message on our stream costs besides the link (serialization, sealing, the p2p daemons, Python).

    A message of ``b`` bytes costs its sender ``send_s + b * cpu_s_per_byte`` of CPU (serialize and seal), then
    travels for ``transit_s`` plus ``b`` at the slower of the link and ``daemon_rate`` (the daemons copy it through
    their sockets), then costs its receiver ``recv_s + b * cpu_s_per_byte`` of CPU (unseal and deserialize).
    ``frame_bytes`` are added to each message (metadata, framing, the AES-GCM tag).
    """

    send_s: float
    recv_s: float
    cpu_s_per_byte: float
    transit_s: float
    daemon_rate: float  # bytes/s
    frame_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("send_s", "recv_s", "cpu_s_per_byte", "transit_s", "frame_bytes"):
            _positive(f"StreamCost.{name}", getattr(self, name))
        _positive("StreamCost.daemon_rate", self.daemon_rate, zero=False)

    def send(self, nbytes: float) -> float:
        return self.send_s + nbytes * self.cpu_s_per_byte

    def recv(self, nbytes: float) -> float:
        return self.recv_s + nbytes * self.cpu_s_per_byte


# Measured on 127.0.0.1 on this project's 2-core x86_64 machine (2026-12-02 07:20 UTC, shared with other work) by
# `python benchmarks/estimator.py --calibrate_only`: CPU per message timed in-process (tensor_messages + AES-GCM seal,
# then unseal + decode) for 4 KB and 256 KB tensors; the rest of training calls' round trips (wall minus the peer's
# compute_ms minus that CPU) for the two sizes, split over their two messages, gives transit and the daemons' rate.
LOOPBACK_STREAM = StreamCost(send_s=41e-6, recv_s=106e-6, cpu_s_per_byte=0.83e-9, transit_s=0.83e-3,
                             daemon_rate=81e6, frame_bytes=178)


@dataclass(frozen=True)
class Stage:
    """Blocks ``[start, end)`` on peer ``peer`` with its measured ``compute``."""

    peer: str
    start: int
    end: int
    compute: Compute

    @property
    def blocks(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Pipeline:
    """A candidate pipeline: ordered stages, the links they use (``links[(src, dst)]``, ``CLIENT`` for the client),
    the client's own compute, the data path (``star``: the client sends to each stage and gets its output back, as
    the code does today; ``chain``: each stage pushes to the next, the last back to the client) and a codec."""

    stages: tuple[Stage, ...]
    links: Mapping[tuple[str, str], Link]
    client: ClientCompute = ClientCompute()
    topology: Topology = "star"
    codec: Codec = NO_CODEC

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("a pipeline needs at least one stage")
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES}, got {self.topology!r}")
        for before, after in zip(self.stages, self.stages[1:], strict=False):
            if before.end != after.start:
                raise ValueError(f"stages must be contiguous: {before.peer} ends at block {before.end}, "
                                 f"{after.peer} starts at {after.start}")
        for stage in self.stages:
            if stage.start >= stage.end or stage.start < 0:
                raise ValueError(f"stage {stage.peer} has an empty or negative span {stage.start}:{stage.end}")
        peers = [s.peer for s in self.stages]
        if CLIENT in peers:
            raise ValueError(f"{CLIENT!r} names the client; give the stage another peer name")
        for src, dst in self.hops():
            if (src, dst) not in self.links:
                raise ValueError(f"no link {src} -> {dst}: the {self.topology} data path needs it; add "
                                 f"links[({src!r}, {dst!r})] = Link(bandwidth=..., latency=...)")

    def check(self, model: ModelShape) -> None:
        """``ValueError`` unless the stages tile the model's blocks."""
        if self.stages[0].start != 0 or self.stages[-1].end != model.num_blocks:
            raise ValueError(f"the stages cover blocks {self.stages[0].start}:{self.stages[-1].end}, the model has "
                             f"0:{model.num_blocks}; add stages for the missing blocks")

    def hops(self) -> list[tuple[str, str]]:
        """The directed links the forward pass uses, in order (the backward pass uses their reverses)."""
        peers = [s.peer for s in self.stages]
        if self.topology == "star":
            return [hop for p in peers for hop in ((CLIENT, p), (p, CLIENT))]
        path = [CLIENT, *peers, CLIENT]
        return list(zip(path, path[1:], strict=False))

    def link(self, src: str, dst: str) -> Link:
        try:
            return self.links[(src, dst)]
        except KeyError:
            raise ValueError(f"no link {src} -> {dst}: add links[({src!r}, {dst!r})]") from None
