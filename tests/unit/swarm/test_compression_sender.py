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
