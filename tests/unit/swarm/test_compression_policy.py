"""AdaTopK's policy: the least lossy codec whose transfer fits under the compute, and its hysteresis."""

from __future__ import annotations

import pytest
import torch

from swarm.compression.codecs import NONE, Codec, payload_bytes
from swarm.compression.policy import (
    MIN_FRACTION,
    TOPK_SLACK,
    AdaptiveChooser,
    adaptive_slack,
    check_setting,
    choose,
    lossiness,
    transfer_time,
)

NUMEL = 8 * 128 * 768  # a micro-batch of GPT-2 small activations
COMPUTE = 0.03  # seconds of the stage's compute per micro-batch


def rate(codec: str | Codec, seconds: float = COMPUTE, dtype: torch.dtype = torch.float32) -> float:
    """The bandwidth (bits/s) at which ``codec`` moves the tensor in exactly ``seconds``."""
    codec = Codec.parse(codec) if isinstance(codec, str) else codec
    return payload_bytes(NUMEL, dtype, codec) * 8 / seconds


def pick(bandwidth: float, **kwargs) -> Codec:
    kwargs.setdefault("compute_s", COMPUTE)
    return choose(NUMEL, kwargs.pop("dtype", torch.float32), bandwidth_bps=bandwidth, **kwargs)


@pytest.mark.parametrize("bandwidth, allowed, expected", [
    (rate("none") * 100, None, "none"),  # a fast link: nothing to gain
    (rate("none") * 1.01, None, "none"),  # just fits
    (rate("none") / 1.01, None, "bf16"),  # a medium link: half precision
    (rate("none") / 1.01, ("none", "fp16", "int8", "topk"), "fp16"),
    (rate("bf16") / 1.01, None, "int8"),
    (rate("int8") / 1.01, ("none", "bf16", "int8"), "int8"),  # nothing fits, no top-k: the fewest bytes
])
def test_fixed_codecs_by_link_speed(bandwidth: float, allowed: tuple[str, ...] | None, expected: str) -> None:
    codec = pick(bandwidth, **({"allowed": allowed} if allowed else {}))
    assert str(codec) == expected


def test_slow_links_get_topk_with_k_shrinking_as_bandwidth_falls() -> None:
    fractions = []
    for divisor in (1.5, 2, 4, 8, 16, 64, 1000):
        bandwidth = rate("int8") / divisor
        codec = pick(bandwidth)
        assert codec.name == "topk" and codec.values == "int8"
        fractions.append(codec.fraction)
        took = transfer_time(NUMEL, torch.float32, codec, bandwidth_bps=bandwidth)
        if codec.fraction > MIN_FRACTION:  # k as large as fits: it fits, a k ~12% larger does not
            assert took <= COMPUTE
            larger = Codec("topk", fraction=min(1.0, codec.fraction * 1.12), values="int8")
            assert transfer_time(NUMEL, torch.float32, larger, bandwidth_bps=bandwidth) > COMPUTE
    assert fractions == sorted(fractions, reverse=True) and len(set(fractions)) >= 5
    assert fractions[-1] == MIN_FRACTION  # far too slow: the floor, though it does not fit


def test_round_trip_and_compute_shift_the_choice() -> None:
    bandwidth = rate("none") * 2  # none takes half the compute...
    assert pick(bandwidth) == NONE
    assert pick(bandwidth, rtt_s=COMPUTE * 0.75).name != "none"  # ...but not with a long round trip
    assert pick(bandwidth, compute_s=COMPUTE / 4).name != "none"  # nor with a faster stage
    assert pick(bandwidth, rtt_s=COMPUTE * 2) == Codec("topk", fraction=MIN_FRACTION, values="int8")


def test_half_precision_tensors_gain_nothing_from_half_codecs() -> None:
    bandwidth = rate("none", dtype=torch.bfloat16) / 1.01
    assert pick(bandwidth, dtype=torch.bfloat16).name in ("int8", "topk")


@pytest.mark.parametrize("kwargs", [
    {"bandwidth_bps": 0.0}, {"bandwidth_bps": float("nan")}, {"compute_s": -1.0}, {"rtt_s": float("inf")},
    {"allowed": ()}, {"allowed": ("gzip",)}, {"min_fraction": 0.0}, {"min_fraction": 1.5},
])
def test_bad_arguments_are_refused(kwargs: dict) -> None:
    args = {"bandwidth_bps": 1e9, "compute_s": COMPUTE, **kwargs}
    with pytest.raises(ValueError):
        choose(NUMEL, torch.float32, **args)


def test_lossiness_orders_codecs() -> None:
    order = ["none", "bf16", "int8", "topk:0.5/int8", "topk:0.1/int8", "topk:0.01/int8"]
    ranks = [lossiness(Codec.parse(text)) for text in order]
    assert ranks == sorted(ranks) and len(set(ranks)) == len(ranks)


def test_chooser_redecides_when_bandwidth_changes() -> None:
    chooser = AdaptiveChooser()
    key = ("peer-b", "forward")

    def decide(bandwidth: float) -> Codec:
        return chooser.decide(key, NUMEL, torch.float32, bandwidth_bps=bandwidth, compute_s=COMPUTE)

    assert decide(rate("none") * 10) == NONE
    assert decide(rate("int8") / 4).name == "topk"  # the link got slow: compress at once
    slow = chooser.current[key].fraction
    assert decide(rate("int8") / 16).fraction < slow  # slower still: fewer values
    assert decide(rate("none") * 10) == NONE  # fast again: back to none
    assert chooser.switches == 3
    other = chooser.decide(("peer-c", "backward"), NUMEL, torch.float32, bandwidth_bps=rate("none") / 1.5,
                           compute_s=COMPUTE)
    assert other.name == "bf16" and chooser.current[key] == NONE  # one decision per key


def test_chooser_does_not_flap_on_noise() -> None:
    """Bandwidth samples +-10% around the link's speed (within the margin, from its first sample on: the first
    decision can sit at either extreme) never change the codec."""
    chooser = AdaptiveChooser(margin=0.25)
    base = rate("none")  # none exactly fills the compute: the worst case for flapping
    decisions = {str(chooser.decide("k", NUMEL, torch.float32, bandwidth_bps=base * (1 + 0.1 * (-1) ** i),
                                    compute_s=COMPUTE)) for i in range(50)}
    assert len(decisions) == 1 and chooser.switches == 0
    topk = {str(chooser.decide("t", NUMEL, torch.float32, bandwidth_bps=rate("int8") / 8 * (1 + 0.1 * (-1) ** i),
                               compute_s=COMPUTE)) for i in range(50)}
    assert len(topk) == 1 and chooser.switches == 0


def test_chooser_without_a_compute_time_keeps_its_codec() -> None:
    chooser = AdaptiveChooser()
    assert chooser.decide("k", NUMEL, torch.float32, bandwidth_bps=1e6, compute_s=None) == NONE
    slow = chooser.decide("k", NUMEL, torch.float32, bandwidth_bps=1e6, compute_s=COMPUTE)
    assert slow.name == "topk"
    assert chooser.decide("k", NUMEL, torch.float32, bandwidth_bps=1e12, compute_s=None) == slow
    with pytest.raises(ValueError):
        AdaptiveChooser(margin=1.0)


@pytest.mark.parametrize("text, expected", [
    ("none", "none"), ("adaptive", "adaptive"), ("fp16", "fp16"), ("int8", "int8"),
    ("topk:0.1/int8", "topk:0.1/int8"),
])
def test_settings(text: str, expected: str) -> None:
    assert check_setting(text) == expected


@pytest.mark.parametrize("text", ["", "gzip", "topk", "topk:0", "topk:2", "Adaptive", "topk:0.1/zip"])
def test_bad_settings_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="compression must be"):
        check_setting(text)


def test_topk_slack_keeps_int8_while_the_link_binds_by_at_most_the_slack() -> None:
    numel, mbit = 4 * 128 * 512, 1e6  # one 1 MiB fp32 hidden state
    int8_s = transfer_time(numel, torch.float32, Codec("int8"), bandwidth_bps=8 * mbit)  # ~0.27 s at 8 Mbit/s
    strict = choose(numel, torch.float32, bandwidth_bps=8 * mbit, compute_s=int8_s / 1.5)
    assert strict.name == "topk"  # the FusionLLM rule: transfer under compute, whatever it drops
    slack = choose(numel, torch.float32, bandwidth_bps=8 * mbit, compute_s=int8_s / 1.5, topk_slack=4.0)
    assert slack == Codec("int8")  # int8 takes 1.5x the compute: within the slack, nothing dropped
    far = choose(numel, torch.float32, bandwidth_bps=8 * mbit, compute_s=int8_s / 5, topk_slack=4.0)
    assert far.name == "topk"
    assert far.fraction < strict.fraction  # beyond the slack: top-k sized to fit under the compute, as before


def test_adaptive_settings_carry_their_slack() -> None:
    assert check_setting("adaptive") == "adaptive" and adaptive_slack("adaptive") == TOPK_SLACK
    assert check_setting("adaptive:1") == "adaptive:1" and adaptive_slack("adaptive:1") == 1.0
    assert check_setting("adaptive:4") == "adaptive:4"
    assert adaptive_slack("int8") is None and adaptive_slack("none") is None
    for bad in ("adaptive:0", "adaptive:inf", "adaptive:-2", "adaptive:abc"):
        with pytest.raises(ValueError, match="needs SLACK in"):
            check_setting(bad)
