"""What the planner minimises: per-token seconds of a stage and of a hop, priced as the estimator prices them.

A pipeline group serves tokens with many micro-batches in flight (the chain data path: each stage pushes its output to
the next). In that steady state every resource works in parallel and the slowest one sets the pace, so a group's rate
is ``1 / bottleneck``, where the bottleneck is the largest of (``swarm.estimator.estimate_training``'s resources):

- a stage: ``blocks x (forward_s + backward_s)`` per token for training (forward only for inference), plus its
  stream CPU: it reads and writes one hidden state per token each way (``StreamCost``: per byte, plus per message
  amortised over ``message_tokens``);
- a hop ``a -> b``: one hidden state per token (``hidden_size x dtype_bytes``, plus framing per message) at the
  slower of ``Link.payload_rate`` (TCP payload of the link) and the p2p daemons' rate; for training the gradient
  goes back ``b -> a`` on the other direction, a separate resource, so the hop costs the slower of the two.

Latency: the estimator's latency is a wait that holds no resource; with enough micro-batches in flight it costs
nothing in the steady state. We still charge one one-way latency per message (``latency / message_tokens`` per
token): a small, conservative term that only counts on high-latency links carrying little, and breaks ties towards
nearer peers. The client's own links are not priced: a group serves many clients (or one trainer, wherever it is).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from swarm.estimator.inputs import LOOPBACK_STREAM, TCP_PAYLOAD_FRACTION, ModelShape, StreamCost
from swarm.plan.types import LinkCost, PlanPeer

OBJECTIVES = ("training", "inference")
MESSAGE_TOKENS = 1024  # tokens of one message (a micro-batch, e.g. 8 rows x 128): per-message costs spread over it


@dataclass(frozen=True)
class CostModel:
    """Per-token costs of stages and hops for a model ``shape`` and an ``objective`` ("training": forward and
    backward, "inference": forward only), on our stream (``stream``: its measured per-message costs)."""

    shape: ModelShape
    objective: str = "training"
    message_tokens: int = MESSAGE_TOKENS
    stream: StreamCost = LOOPBACK_STREAM

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if not isinstance(self.message_tokens, int) or self.message_tokens < 1:
            raise ValueError(f"message_tokens must be an integer >= 1, got {self.message_tokens!r}")
        token_bytes = self.shape.hidden_size * self.shape.dtype_bytes + self.stream.frame_bytes / self.message_tokens
        pairs = 2 if self.training else 1
        stream = pairs * ((self.stream.send_s + self.stream.recv_s) / self.message_tokens
                          + 2 * token_bytes * self.stream.cpu_s_per_byte)
        object.__setattr__(self, "_token_bytes", token_bytes)  # constants of the hot paths, computed once
        object.__setattr__(self, "_stream_s", stream)

    @property
    def training(self) -> bool:
        return self.objective == "training"

    @property
    def token_bytes(self) -> float:
        """Bytes one token's hidden state takes on the wire, framing of its message included."""
        return self._token_bytes  # type: ignore[attr-defined]

    def block_s(self, peer: PlanPeer) -> float:
        """Seconds per token of one block on ``peer`` (forward, plus backward for training)."""
        return peer.forward_s + peer.backward_s if self.training else peer.forward_s

    def stream_s(self) -> float:
        """Seconds per token a stage's CPU spends on the stream: one message in and one out per direction
        (``stream``'s per-message costs over ``message_tokens``, its per-byte cost on each token's bytes)."""
        return self._stream_s  # type: ignore[attr-defined]

    def stage_times(self, peer: PlanPeer, most: int) -> list[float]:
        """``stage_s(peer, b)`` for ``b`` in ``1..most`` (the same arithmetic, in one go)."""
        per_block, fixed = self.block_s(peer), self._stream_s  # type: ignore[attr-defined]
        return [b * per_block + fixed for b in range(1, most + 1)]

    def stage_s(self, peer: PlanPeer, blocks: int) -> float:
        """Seconds per token of ``blocks`` blocks on ``peer`` (0 blocks: the peer is not in the pipeline: 0)."""
        return blocks * self.block_s(peer) + self._stream_s if blocks > 0 else 0.0  # type: ignore[attr-defined]

    def max_blocks_within(self, peer: PlanPeer, seconds: float) -> int:
        """The most blocks ``peer`` can hold with ``stage_s <= seconds`` (its memory permitting); 0 if none."""
        per_block, fixed = self.block_s(peer), self._stream_s  # type: ignore[attr-defined]
        if seconds < fixed + per_block:
            return 0
        blocks = min(peer.max_blocks, int((seconds - fixed) / per_block))
        while blocks > 0 and self.stage_s(peer, blocks) > seconds:  # float rounding: the same formula decides
            blocks -= 1
        while blocks < peer.max_blocks and self.stage_s(peer, blocks + 1) <= seconds:
            blocks += 1
        return blocks

    def direction_s(self, bandwidth: float, rtt: float) -> float:
        """Seconds per token on one direction of a link of ``bandwidth`` bits/s and round trip ``rtt``."""
        rate = min(bandwidth / 8 * TCP_PAYLOAD_FRACTION, self.stream.daemon_rate)
        return self._token_bytes / rate + rtt / 2 / self.message_tokens  # type: ignore[attr-defined]

    def hop_s(self, links: LinkCost, a: str, b: str) -> float:
        """Seconds per token of the hop ``a -> b``: the forward direction, and for training also the gradient's
        direction ``b -> a`` (the slower of the two: they are separate resources)."""
        forward = self.direction_s(*links(a, b))
        return max(forward, self.direction_s(*links(b, a))) if self.training else forward

    def bottleneck(self, spans: Sequence[tuple[PlanPeer, int]], links: LinkCost) -> float:
        """Seconds per token of a pipeline of ``(peer, blocks)`` in order (peers with 0 blocks are skipped): the
        slowest of its stages and hops."""
        used = [(peer, blocks) for peer, blocks in spans if blocks > 0]
        worst = max((self.stage_s(peer, blocks) for peer, blocks in used), default=0.0)
        for (first, _), (second, _) in zip(used, used[1:], strict=False):
            worst = max(worst, self.hop_s(links, first.peer_id, second.peer_id))
        return worst
