"""AdaTopK: which codec a tensor travels in over one link, so that its transfer hides under the compute it overlaps.

A pipeline stage sends a micro-batch's activations (or grads) while it computes the next one: the link costs nothing
while ``payload_bytes * 8 / bandwidth + rtt <= compute``. ``choose`` takes the least lossy codec for which that
holds, in the order none > bf16 > fp16 > int8 > top-k (its fraction as large as fits, values in int8), with a floor
on top-k's fraction: when even the floor does not fit, the floor is sent (the link is then the bottleneck, as little
as the floor allows). Links that are fast for their stage's compute are left uncompressed, the slowest compressed most.

``AdaptiveChooser`` keeps one decision per key (a link and direction) and re-decides as the measurements change, with
hysteresis: it compresses more only when the current codec overshoots the compute by more than ``margin``, and less
only when a less lossy codec fits with ``margin`` to spare, so measurement noise does not flip the codec every message.

The run-level setting (``check_setting``): "none", a fixed codec's text ("fp16", "int8", "topk:0.1/int8"), or
"adaptive" (this policy, per link and direction).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable

import torch

from swarm.compression.codecs import CODECS, NONE, Codec, payload_bytes

MIN_FRACTION = 0.01  # top-k never keeps less than this share of the elements
VALUES = "int8"  # how top-k's kept values travel
MARGIN = 0.25  # hysteresis of ``AdaptiveChooser``: a share of the compute time
ADAPTIVE = "adaptive"
# "adaptive" in a training run: top-k (lossy, and with no error feedback for activations) only where even int8 would
# take more than this many times the compute; below that the link binds and quantization stays (measured: int8 costs
# no held-out loss, top-k at half the values ~10%, and a run that sent a tenth of its slow link's messages as top-k
# +4%, where int8 took ~3.5x the compute: benchmarks/README.md, "Training over slow links"; 4 was on that edge)
TOPK_SLACK = 8.0
MAX_SLACK = 1000.0
FIXED_ORDER = ("none", "bf16", "fp16", "int8")  # least lossy first; bf16 before fp16: it never overflows to inf
_SEARCH_STEPS = 40  # bisection steps for top-k's fraction


def transfer_time(numel: int, dtype: torch.dtype, codec: Codec, *, bandwidth_bps: float, rtt_s: float = 0.0
                  ) -> float:
    """Seconds to send ``numel`` values of ``dtype`` in ``codec`` over a link: its payload at the bandwidth, plus a
    round trip (a push waits for its ack)."""
    return payload_bytes(numel, dtype, codec) * 8 / bandwidth_bps + rtt_s


def lossiness(codec: Codec) -> tuple[int, float]:
    """Orders codecs from the least lossy (none) to the most (top-k with the smallest fraction)."""
    rank = {"none": 0, "bf16": 1, "fp16": 1, "int8": 2, "topk": 3}[codec.name]
    return rank, -codec.fraction if codec.name == "topk" else 0.0


def choose(numel: int, dtype: torch.dtype, *, bandwidth_bps: float, compute_s: float, rtt_s: float = 0.0,
           allowed: Iterable[str] = CODECS, min_fraction: float = MIN_FRACTION, values: str = VALUES,
           topk_slack: float = 1.0) -> Codec:
    """The least lossy allowed codec whose transfer time fits under ``compute_s`` (see the module's docstring);
    with none fitting, top-k at ``min_fraction`` (or, top-k not allowed, the allowed codec of the fewest bytes).
    ``topk_slack`` > 1: while the fewest-bytes quantizing codec takes at most ``topk_slack * compute_s``, it is
    chosen rather than top-k (the link binds, by at most that factor, but nothing is dropped)."""
    allowed = tuple(allowed)
    _check(numel, bandwidth_bps, compute_s, rtt_s, allowed, min_fraction)

    def fits(codec: Codec) -> bool:
        return transfer_time(numel, dtype, codec, bandwidth_bps=bandwidth_bps, rtt_s=rtt_s) <= compute_s

    fixed = [Codec(name) for name in FIXED_ORDER if name in allowed]
    for codec in fixed:
        if fits(codec):
            return codec
    cheapest = min(fixed, key=lambda c: (payload_bytes(numel, dtype, c), lossiness(c)), default=None)
    if "topk" not in allowed:
        assert cheapest is not None  # ``_check``: something is allowed
        return cheapest
    if cheapest is not None and topk_slack > 1 and \
            transfer_time(numel, dtype, cheapest, bandwidth_bps=bandwidth_bps, rtt_s=rtt_s) <= topk_slack * compute_s:
        return cheapest
    floor = Codec("topk", fraction=min_fraction, values=values)
    if not fits(floor):
        return floor
    low, high = min_fraction, 1.0  # fits(low), and the largest fraction that fits is in [low, high]
    for _ in range(_SEARCH_STEPS):
        middle = (low + high) / 2
        low, high = (middle, high) if fits(Codec("topk", fraction=middle, values=values)) else (low, middle)
    return Codec("topk", fraction=max(min_fraction, _round_down(low)), values=values)


class AdaptiveChooser:
    """``choose`` per key (e.g. ``(peer id, "forward")``), re-decided on every message with hysteresis."""

    def __init__(self, *, margin: float = MARGIN, allowed: Iterable[str] = CODECS,
                 min_fraction: float = MIN_FRACTION, values: str = VALUES, topk_slack: float = 1.0) -> None:
        if not 0 <= margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {margin}")
        self.margin, self.allowed, self.min_fraction, self.values = margin, tuple(allowed), min_fraction, values
        self.topk_slack = topk_slack
        self.current: dict[Hashable, Codec] = {}
        self.switches = 0  # decisions that changed a key's codec (the first decision of a key not counted)

    def decide(self, key: Hashable, numel: int, dtype: torch.dtype, *, bandwidth_bps: float,
               compute_s: float | None, rtt_s: float = 0.0) -> Codec:
        """The codec for the next message of ``key``; ``compute_s`` None (not measured yet): the key's current codec,
        none at first."""
        current = self.current.get(key)
        if compute_s is None:
            return current or NONE

        def pick(budget: float) -> Codec:
            return choose(numel, dtype, bandwidth_bps=bandwidth_bps, compute_s=budget, rtt_s=rtt_s,
                          allowed=self.allowed, min_fraction=self.min_fraction, values=self.values,
                          topk_slack=self.topk_slack)

        if current is None:
            decided = pick(compute_s)
        else:
            took = transfer_time(numel, dtype, current, bandwidth_bps=bandwidth_bps, rtt_s=rtt_s)
            decided = current
            if took > compute_s * (1 + self.margin):  # overshoots: compress more (to what fits now)
                tighter = pick(compute_s)
                decided = tighter if lossiness(tighter) > lossiness(current) else current
            else:  # fits (or nearly): compress less only where that leaves room to spare
                looser = pick(compute_s * (1 - self.margin))
                if lossiness(looser) < lossiness(current):
                    decided = looser
            if decided != current:
                self.switches += 1
        self.current[key] = decided
        return decided


def check_setting(text: str) -> str:
    """A run's compression setting, checked: "none", "adaptive", "adaptive:SLACK" (top-k only where int8 would
    take more than SLACK times the compute; 1: as soon as int8 does not fit) or a codec's text; ``ValueError``
    otherwise."""
    if not isinstance(text, str):
        raise ValueError(f"compression must be a string, got {type(text).__name__}")
    if text == ADAPTIVE or text.startswith(ADAPTIVE + ":"):
        slack = adaptive_slack(text)
        return ADAPTIVE if slack == TOPK_SLACK and text == ADAPTIVE else f"{ADAPTIVE}:{slack:g}"
    try:
        return str(Codec.parse(text))
    except ValueError as e:
        raise ValueError(f"compression must be 'none', 'adaptive', 'adaptive:SLACK' or a codec like 'fp16', 'bf16', "
                         f"'int8', 'topk:0.1/int8': {e}") from None


def adaptive_slack(setting: str) -> float | None:
    """The top-k slack of an "adaptive[:SLACK]" setting (``TOPK_SLACK`` for plain "adaptive"); None for any other
    setting; ``ValueError`` for a SLACK that is not a number in [1, MAX_SLACK]."""
    if setting == ADAPTIVE:
        return TOPK_SLACK
    if not setting.startswith(ADAPTIVE + ":"):
        return None
    text = setting[len(ADAPTIVE) + 1:]
    try:
        slack = float(text)
    except ValueError:
        slack = math.nan
    if not 1.0 <= slack <= MAX_SLACK:  # NaN fails too
        raise ValueError(f"compression 'adaptive:SLACK' needs SLACK in [1, {MAX_SLACK:g}], got {text[:16]!r}")
    return slack


def _round_down(fraction: float) -> float:
    """``fraction`` rounded down to two significant digits (short codec texts, stable decisions)."""
    step = 10.0 ** (math.floor(math.log10(fraction)) - 1)
    return round(math.floor(fraction / step + 1e-9) * step, 12)


def _check(numel: int, bandwidth_bps: float, compute_s: float, rtt_s: float, allowed: tuple[str, ...],
           min_fraction: float) -> None:
    problems = []
    if not isinstance(numel, int) or numel < 0:
        problems.append(f"numel must be an int >= 0, got {numel!r}")
    if not (math.isfinite(bandwidth_bps) and bandwidth_bps > 0):
        problems.append(f"bandwidth_bps must be a finite number > 0, got {bandwidth_bps!r}")
    if not (math.isfinite(compute_s) and compute_s >= 0) or not (math.isfinite(rtt_s) and rtt_s >= 0):
        problems.append(f"compute_s and rtt_s must be finite numbers >= 0, got {compute_s!r}, {rtt_s!r}")
    if not allowed or any(name not in CODECS for name in allowed):
        problems.append(f"allowed must name codecs of {list(CODECS)}, got {list(allowed)}")
    if not 0 < min_fraction <= 1:
        problems.append(f"min_fraction must be in (0, 1], got {min_fraction!r}")
    if problems:
        raise ValueError("; ".join(problems))
