"""Compressed averaging rounds (issue 14): a replica sends its delta from the shared anchor, with error feedback.

Under a run's compression setting other than "none", a replica does not push its parameters but ``flat - anchor``
(the anchor: the parameters after the previous round, the same on every replica) plus its error-feedback residual,
encoded. A receiver rebuilds ``anchor + decoded``; the sender averages that same value for itself (its ``member``),
not its exact parameters, so every replica averages the same members and computes bit-identical means. What the
codec dropped (``delta - decoded``) stays with the sender and is added to its next round's delta
(``swarm.compression.feedback.ErrorFeedback``): over rounds nothing is lost. The residual belongs to one averager
(one run and set of replicas); a new averager starts without one.

The anchor travels as a digest (``anchor_digest``, in ``ParamsPush.anchor``). A receiver whose anchor differs (the
replicas averaged different groups in a round, or opened from different weights) or does not know its anchor for that
round yet refuses the delta with ``ANCHOR_REFUSED`` in its message; the sender then sends its member in full (exact
float32, ``anchor=""``: for 16-bit parameters twice their size) to that replica for that round, so every replica
still averages the same value for it. The delta itself travels in the parameters' dtype.

Which codec: a fixed setting ("fp16", "int8", "topk:0.1/int8") is used as it is. "adaptive" picks one codec per round
for all replicas (each must receive the same member), with ``swarm.compression.policy`` from the slowest link among
them: the least lossy codec whose transfer fits in the time of the local steps since the previous round (averaging
then costs at most as long as the steps it follows). Should it pick "none", the member is the exact parameters plus
the residual, sent in full, and the residual is spent.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from swarm.compression.codecs import Codec, Encoded, decode, encode
from swarm.compression.feedback import ErrorFeedback
from swarm.compression.policy import AdaptiveChooser, adaptive_slack, check_setting
from swarm.links import DEFAULT_LINK, LinkTable

ANCHOR_REFUSED = "anchor differs"  # in a refusal of a delta: the sender sends its parameters in full instead
MAX_DIGEST = 64  # characters of an anchor digest a receiver looks at
_KEY = "delta"  # the error-feedback key of an averager's round series


def anchor_digest(anchor: torch.Tensor) -> str:
    """A short hash of the anchor's float32 bytes: replicas whose digests agree hold bit-identical anchors."""
    data = anchor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    return hashlib.blake2b(data, digest_size=12).hexdigest()


@dataclass(frozen=True)
class Prepared:
    """One replica's push of a round: what every replica averages for it, and what travels."""

    member: torch.Tensor  # float32, CPU: the anchor plus the decoded delta (or the parameters plus the residual)
    payload: torch.Tensor | Encoded  # the encoded delta, or ``member`` itself (anchor "")
    anchor: str  # the anchor's digest with a delta; "" = full parameters
    codec: Codec


class DeltaCompression:
    """The sending side of one averager's compressed rounds (``setting`` checked: ``ValueError`` if bad)."""

    def __init__(self, setting: str = "none", links: LinkTable | None = None, *, error_feedback: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.setting = check_setting(setting)
        # with error feedback top-k loses nothing over rounds: "adaptive" here uses top-k as soon as int8 does not fit
        self.fixed = None if adaptive_slack(self.setting) is not None else Codec.parse(self.setting)
        self.links, self.error_feedback, self.clock = links, error_feedback, clock
        self.feedback = ErrorFeedback()
        self.chooser = AdaptiveChooser()
        self.since = clock()  # when the local steps that the next round follows began

    def matches(self, setting: str) -> bool:
        """Whether ``setting`` (checked at the run's open) is ours."""
        return check_setting(setting) == self.setting

    @property
    def active(self) -> bool:
        """False for "none": rounds push the parameters as they are (bit-exact, the wire of before)."""
        return self.fixed is None or not self.fixed.exact

    def codec(self, numel: int, replicas: list[str]) -> Codec:
        """The codec of this round's delta, the same for every replica."""
        if self.fixed is not None:
            return self.fixed
        links = [(self.links.get(p) if self.links is not None else None) or DEFAULT_LINK for p in replicas]
        slowest = min(links, key=lambda link: link.bandwidth, default=DEFAULT_LINK)
        rtt = max((link.rtt for link in links), default=DEFAULT_LINK.rtt)
        return self.chooser.decide(_KEY, numel, torch.float32, bandwidth_bps=slowest.bandwidth,
                                   compute_s=max(0.0, self.clock() - self.since), rtt_s=rtt)

    def prepare(self, flat: torch.Tensor, anchor: torch.Tensor, digest: str, replicas: list[str]) -> Prepared:
        """This round's push of parameters ``flat`` against ``anchor`` (float32, CPU; its digest ``digest``)."""
        params = flat.detach().to("cpu", torch.float32)
        delta = params - anchor
        codec = self.codec(delta.numel(), replicas)
        if codec.exact:  # adaptive chose none: everything goes, the residual with it
            member = self.feedback.corrected(_KEY, delta) + anchor if self.error_feedback else params
            self.feedback.reset(_KEY)
            return Prepared(member, member, "", codec)
        # the delta travels in the parameters' dtype (decoded, no larger than the parameters were on the wire);
        # the residual is kept in float32 and takes the rounding to that dtype too
        if self.error_feedback:
            encoded = self.feedback.compress(_KEY, delta, codec, dtype=flat.dtype)
        else:
            encoded = encode(delta.to(flat.dtype), codec)
        decoded = decode(encoded.serialized, max_bytes=delta.numel() * 4).tensor.to(torch.float32)
        return Prepared(anchor + decoded, encoded, digest, codec)

    def round_done(self) -> None:
        """A round ended: the local steps the next one follows begin now."""
        self.since = self.clock()
