"""How one node (a stage or the trainer) sends the tensors of a training run: the run's compression setting applied
per link and direction.

"none" sends the tensor as it is (bit-exact, today's wire). A fixed codec ("fp16", "int8", "topk:0.1/int8") is used
on every link. "adaptive" asks the policy (``swarm.compression.policy``) per (peer, direction), from this node's
measured link to that peer (``swarm.links.LinkTable``; an unknown link takes its conservative defaults) and the
compute time the transfer overlaps (the sender's own time on the micro-batch, or the one the receiver reported).

The gradient of an input that came top-k'd goes back in the same pattern (``indices``): with ``x~ = mask * x`` the
stage's compressed forward has ``dL/dx = mask * dL/dx~``, so nothing is dropped and no residual is kept.

``send`` returns what travels and what the receiver will decode (``arrived``): a stage keeps the latter for replays,
so a stage replayed from its neighbours' kept tensors computes on exactly what it got in the step.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable

import torch

from privacy.peer_ids import short_id
from swarm.compression.codecs import NONE, VALUE_CODECS, Codec, Encoded, decode, encode
from swarm.compression.policy import VALUES, AdaptiveChooser, adaptive_slack, check_setting
from swarm.links import DEFAULT_LINK, LinkTable, RobustEma

logger = logging.getLogger(__name__)

FORWARD, BACKWARD = "forward", "backward"


class RunCompression:
    """One node's sending side of a run's compression ``setting`` (checked: ``ValueError`` if bad)."""

    def __init__(self, setting: str = "none", links: LinkTable | None = None) -> None:
        self.setting = check_setting(setting)
        slack = adaptive_slack(self.setting)
        self.fixed = None if slack is not None else Codec.parse(self.setting)
        self.links = links
        self.chooser = AdaptiveChooser(topk_slack=slack or 1.0)
        # (peer, direction) -> seconds of the compute a transfer overlaps, smoothed (one micro-batch's jitters)
        self.compute: dict[Hashable, RobustEma] = {}
        self.sent: dict[str, int] = {}  # codec text -> tensors sent in it (for logs and tests)

    @property
    def exact(self) -> bool:
        return self.fixed is not None and self.fixed.exact

    @property
    def values(self) -> str:
        """How top-k values travel when the pattern is forced (the grad of a top-k input)."""
        if self.fixed is None:
            return VALUES
        if self.fixed.name == "topk":
            return self.fixed.values
        return self.fixed.name if self.fixed.name in VALUE_CODECS else "none"

    def codec(self, peer: str, direction: str, tensor: torch.Tensor, compute_s: float | None = None) -> Codec:
        """The codec of ``tensor``'s next message to ``peer`` in ``direction`` (``compute_s`` None: the last one
        noted for that link and direction, if any)."""
        if self.fixed is not None:
            return self.fixed
        if not tensor.is_floating_point():
            return NONE
        key = (peer, direction)
        if compute_s is None:
            noted = self.compute.get(key)
            compute_s = noted.value if noted is not None else None
        link = (self.links.get(peer) if self.links is not None else None) or DEFAULT_LINK
        before = self.chooser.current.get(key)
        decided = self.chooser.decide(key, tensor.numel(), tensor.dtype, bandwidth_bps=link.capacity,
                                      compute_s=compute_s, rtt_s=link.rtt)
        if decided != before:
            logger.info("Compression to %s (%s): %s (link %.1f Mbit/s, rtt %.1f ms; compute %s)", short_id(peer),
                        direction, decided, link.capacity / 1e6, link.rtt * 1e3,
                        "not measured" if compute_s is None else f"{compute_s * 1e3:.0f} ms")
        return decided

    def reply_codec(self, peer: str, direction: str, like: torch.Tensor) -> str:
        """Under "adaptive", the codec (as text) that ``peer`` should return a tensor like ``like`` to us in, in
        ``direction``, from our measured link to it and the compute it last reported for it (``note_compute`` with
        ``"reply-" + direction``); "" otherwise: the peer follows the run's setting. A stage cannot measure its link to
        a trainer (it only answers on the trainer's stream), so the trainer chooses for it."""
        if self.fixed is not None:
            return ""
        return str(self.codec(peer, "reply-" + direction, like))

    def note_compute(self, peer: str, direction: str, seconds: float) -> None:
        """The compute a transfer to ``peer`` in ``direction`` overlaps (e.g. that peer's reported ``compute_ms``)."""
        if seconds > 0:
            self.compute.setdefault((peer, direction), RobustEma()).add(seconds)

    def send(self, peer: str, direction: str, tensor: torch.Tensor, *, compute_s: float | None = None,
             indices: torch.Tensor | None = None, codec: Codec | None = None
             ) -> tuple[torch.Tensor | Encoded, torch.Tensor]:
        """(what travels: the tensor itself or its ``Encoded`` form, what the receiver decodes). ``indices``: the
        pattern the tensor must travel in (the grad of a top-k input); ``codec``: the receiver's choice (a stage's
        reply to a trainer that measured the link), else the setting decides."""
        if indices is not None:
            codec = Codec("topk", fraction=max(indices.numel(), 1) / max(tensor.numel(), 1), values=self.values)
        elif codec is None or self.setting == "none":
            codec = self.codec(peer, direction, tensor, compute_s)
        self.sent[str(codec)] = self.sent.get(str(codec), 0) + 1
        if codec.exact:
            return tensor, tensor
        encoded = encode(tensor, codec, indices=indices)
        itemsize = tensor.element_size()
        arrived = decode(encoded.serialized, max_bytes=tensor.numel() * itemsize).tensor
        return encoded, arrived.to(tensor.device)
