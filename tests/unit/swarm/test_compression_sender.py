"""A node's sending side of a run's compression setting: fixed codecs, adaptive per measured link, forced patterns."""

from __future__ import annotations

import pytest
import torch

from swarm.compression import Encoded, decode
from swarm.compression.sender import BACKWARD, FORWARD, RunCompression
from swarm.links import LinkTable

HIDDEN = torch.randn(4, 64, 256, generator=torch.Generator().manual_seed(0))  # 256 KiB in fp32


def test_none_sends_the_tensor_itself() -> None:
    sending = RunCompression("none")
    payload, arrived = sending.send("b", FORWARD, HIDDEN)
    assert payload is HIDDEN and arrived is HIDDEN and sending.exact


def test_a_fixed_codec_is_used_on_every_link_and_arrived_is_what_decodes() -> None:
    sending = RunCompression("int8")
    payload, arrived = sending.send("b", FORWARD, HIDDEN, compute_s=10.0)
    assert isinstance(payload, Encoded)
    assert torch.equal(arrived, decode(payload.serialized, max_bytes=1 << 24).tensor)
    assert sending.sent == {"int8": 1}


def test_adaptive_follows_the_measured_link() -> None:
    links = LinkTable()
    sending = RunCompression("adaptive", links)
    compute = 0.01
    assert sending.codec("fast", FORWARD, HIDDEN, compute).name == "topk"  # unmeasured: a 10 Mbit/s default
    for _ in range(8):  # 1 MiB in 1 ms over a 0.1 ms round trip: ~8 Gbit/s
        links.observe("fast", 1e-4, 0.0, 0)
        links.observe("fast", 1.1e-3, 0.0, 1 << 20)
    assert sending.codec("fast", BACKWARD, HIDDEN, compute).name == "none"
    assert sending.codec("other", BACKWARD, HIDDEN, None).name == "none"  # no compute time known yet
    sending.note_compute("other", BACKWARD, compute)
    assert sending.codec("other", BACKWARD, HIDDEN).name == "topk"


def test_a_forced_pattern_keeps_exactly_those_indices() -> None:
    sending = RunCompression("adaptive")
    pattern = torch.arange(0, HIDDEN.numel(), 7)
    payload, arrived = sending.send("b", BACKWARD, HIDDEN, indices=pattern)
    assert isinstance(payload, Encoded) and torch.equal(payload.indices, pattern)
    outside = torch.ones(HIDDEN.numel(), dtype=torch.bool)
    outside[pattern] = False
    assert not arrived.reshape(-1)[outside].any() and arrived.reshape(-1)[pattern].any()  # int8 values may round to 0


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="compression must be"):
        RunCompression("zip")


def test_a_trainer_chooses_the_codec_of_what_a_stage_returns_to_it_only_under_adaptive() -> None:
    links = LinkTable()
    adaptive = RunCompression("adaptive", links)
    assert adaptive.reply_codec("stage", FORWARD, HIDDEN) == "none"  # no compute reported yet: nothing to hide under
    adaptive.note_compute("stage", "reply-" + FORWARD, 0.01)
    assert adaptive.reply_codec("stage", FORWARD, HIDDEN).startswith("topk")  # unmeasured: the 10 Mbit/s default
    for _ in range(8):  # ~8 Gbit/s measured: the reply goes as it is
        links.observe("stage", 1e-4, 0.0, 0)
        links.observe("stage", 1.1e-3, 0.0, 1 << 20)
    assert adaptive.reply_codec("stage", FORWARD, HIDDEN) == "none"
    assert RunCompression("int8").reply_codec("stage", FORWARD, HIDDEN) == ""  # fixed: the stage knows it
    assert RunCompression("none").reply_codec("stage", FORWARD, HIDDEN) == ""


def test_a_codec_chosen_by_the_receiver_is_used_unless_the_run_is_exact() -> None:
    from swarm.compression import Codec

    payload, _ = RunCompression("adaptive").send("t", FORWARD, HIDDEN, codec=Codec("fp16"))
    assert isinstance(payload, Encoded) and decode(payload.serialized, max_bytes=1 << 24).tensor.dtype == HIDDEN.dtype
    payload, _ = RunCompression("none").send("t", FORWARD, HIDDEN, codec=Codec("fp16"))
    assert payload is HIDDEN


def test_a_jittery_compute_time_does_not_flap_the_codec() -> None:
    """The compute a transfer hides under is smoothed: a stage's time per micro-batch jitters 2-3x on a shared
    machine (these are a stage's on the 8 Mbit/s benchmark link, read as 4.5 Mbit/s), wider than the hysteresis, and
    int8 / top-k alternated message by message when each message used the last micro-batch's time alone."""
    links = LinkTable()
    links.observe_probe("next", [2.5e-3] * 4, 1 << 20, 2.5e-3 + 8 * (1 << 20) / 4.5e6)
    hidden = torch.randn(4, 128, 256, generator=torch.Generator().manual_seed(1))  # int8: 0.24 s at 4.5 Mbit/s
    sending = RunCompression("adaptive", links)
    jitter = [0.068, 0.056, 0.043, 0.065, 0.092, 0.053, 0.091, 0.053, 0.041, 0.071, 0.085, 0.054, 0.105, 0.056,
              0.090, 0.061, 0.134, 0.059, 0.079, 0.093, 0.044, 0.102, 0.052, 0.121, 0.043, 0.076, 0.077, 0.093]
    chosen = []
    for seconds in jitter:
        sending.note_compute("next", FORWARD, seconds)
        chosen.append(str(sending.codec("next", FORWARD, hidden)))
    assert sending.chooser.switches <= 2, chosen  # one message at a time it switched 23 times here
    assert chosen[-1] == "int8"  # 0.24 s within 4x the ~70 ms smoothed compute: quantize, drop nothing
