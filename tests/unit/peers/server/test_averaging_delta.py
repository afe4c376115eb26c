"""Compressed averaging rounds: deltas from the anchor with error feedback (averagers wired in-process through a
stand-in stream that encodes and decodes as the wire does)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from peers.server.averaging import ReplicaAverager
from peers.server.averaging_delta import ANCHOR_REFUSED, DeltaCompression, anchor_digest
from peers.wire.errors import RequestError
from peers.wire.messages import ParamsPush
from swarm.compression.codecs import Codec, Encoded, decode, payload_bytes, serialize_none
from swarm.links import LinkEstimate

A, B, C = "12D3KooWAAAAAAAA", "12D3KooWBBBBBBBB", "12D3KooWCCCCCCCC"
NUMEL = 1000


class _Wire:
    """Stands in for a PeerStream: serializes the push as the wire does, delivers it, counts bytes and refusals."""

    def __init__(self, sender: str, target: ReplicaAverager, log: dict[str, list]) -> None:
        self.sender, self.target, self.log = sender, target, log

    async def call(self, message, tensor, timeout):
        message = ParamsPush.from_bytes(message.to_bytes())
        serialized = tensor.serialized if isinstance(tensor, Encoded) else serialize_none(tensor)
        self.log["bytes"].append(serialized.ByteSize())
        self.log["anchors"].append(message.anchor)
        received = decode(serialized, max_bytes=NUMEL * 8).tensor
        self.log["dtypes"].append(received.dtype)
        try:
            self.target.receive(self.sender, message.round, received, NUMEL, message.anchor)
        except ValueError as e:
            self.log["refused"].append(str(e))
            raise RequestError(f"refused ParamsPush: {e}") from None
        return None, None


def _wired(averagers: dict[str, ReplicaAverager]) -> dict[str, list]:
    """Connect the averagers to each other; the log of their pushes."""
    log: dict[str, list] = {"bytes": [], "anchors": [], "refused": [], "dtypes": []}

    def stream_for(sender: str):
        async def get(peer: str):
            return _Wire(sender, averagers[peer], log)
        return get

    for peer, averager in averagers.items():
        averager.stream_for = stream_for(peer)
    return log


def _group(peers: list[str], **options) -> tuple[list[ReplicaAverager], dict[str, list]]:
    averagers = {peer: ReplicaAverager(peer, "run", [p for p in peers if p != peer], None, timeout=5, **options)
                 for peer in peers}
    return list(averagers.values()), _wired(averagers)


def _round(averagers: list[ReplicaAverager], flats: list[torch.Tensor]) -> list[torch.Tensor]:
    async def run():
        return await asyncio.gather(*(a.average(f) for a, f in zip(averagers, flats, strict=True)))
    return list(asyncio.run(run()))


def test_compressed_rounds_keep_the_replicas_bit_identical_after_every_round():
    torch.manual_seed(0)
    start = torch.randn(NUMEL)
    averagers, log = _group([A, B, C], anchor=start, compression="topk:0.1/int8")
    params = start
    for _ in range(5):
        local = [params + 0.01 * torch.randn(NUMEL) for _ in averagers]  # each replica's own local steps
        new = _round(averagers, local)
        assert all(torch.equal(new[0], n) for n in new[1:])
        assert not torch.equal(new[0], sum(local) / 3)  # lossy: not the exact mean in one round
        params = new[0]
    assert not log["refused"] and all(log["anchors"])  # every push a delta, every anchor the same
    assert len({a.digest() for a in averagers}) == 1


@pytest.mark.parametrize("codec", ["topk:0.1/int8", "topk:0.05", "int8"])
def test_error_feedback_brings_the_replicas_to_the_exact_average_and_without_it_the_drop_is_lost(codec):
    """Parameters that stop changing: with error feedback each round delivers what earlier ones dropped, so the
    replicas converge to the exact mean of their parameters; without it top-k loses the same small values forever."""
    torch.manual_seed(1)
    start = torch.randn(NUMEL)
    trained = [start + torch.randn(NUMEL) * 0.1, start + torch.randn(NUMEL) * 0.1]
    exact = (trained[0] + trained[1]) / 2
    errors = {}
    for feedback in (True, False):
        averagers, _ = _group([A, B], anchor=start, compression=codec, error_feedback=feedback)

        async def rounds(averagers: list[ReplicaAverager]) -> list[float]:  # one loop for all (one a round: slow)
            new, errors = list(trained), []
            for _ in range(60):
                new = await asyncio.gather(*(a.average(f) for a, f in zip(averagers, new, strict=True)))
                assert torch.equal(new[0], new[1])
                errors.append((new[0] - exact).abs().max().item())
            return errors

        history = asyncio.run(rounds(averagers))
        first, errors[feedback] = history[0], history[-1]
    assert errors[True] < 1e-5 < first
    assert errors[True] < errors[False] / 100


def test_a_delta_from_another_anchor_is_refused_and_the_sender_sends_its_parameters_in_full():
    torch.manual_seed(2)
    averager = ReplicaAverager(A, "run", [B], None, anchor=torch.zeros(NUMEL), compression="int8")
    with pytest.raises(ValueError, match=f"{ANCHOR_REFUSED}: the delta is from anchor 'f00'.*send the parameters in "
                                         "full"):
        averager.receive(B, 0, torch.ones(NUMEL), NUMEL, "f00")
    with pytest.raises(ValueError, match=f"{ANCHOR_REFUSED}: a delta for round 1 .* not known yet"):
        averager.receive(B, 1, torch.ones(NUMEL), NUMEL, averager.digest())
    assert not averager._inbox  # refused: nothing kept

    # two replicas whose anchors differ (they opened from different weights): each refuses the other's delta, each
    # then sends what it averages for itself in full, and the two agree again, bit for bit, anchors included
    a, b = (ReplicaAverager(p, "run", [q], None, anchor=w, compression="topk:0.1/int8")
            for p, q, w in ((A, B, torch.zeros(NUMEL)), (B, A, torch.full((NUMEL,), 0.5))))
    log = _wired({A: a, B: b})
    first = _round([a, b], [torch.randn(NUMEL), torch.randn(NUMEL)])
    assert torch.equal(first[0], first[1]) and a.last_group == b.last_group == 2
    assert len(log["refused"]) == 2 and all(ANCHOR_REFUSED in r for r in log["refused"])
    assert log["anchors"].count("") == 2  # the two pushes in full
    assert a.digest() == b.digest()
    second = _round([a, b], [first[0] + 0.01, first[1] - 0.01])
    assert torch.equal(second[0], second[1]) and len(log["refused"]) == 2  # deltas accepted again


@pytest.mark.parametrize("codec", ["fp16", "int8", "topk:0.1/int8", "topk:0.02"])
def test_bytes_sent_per_round_shrink_by_the_codecs_ratio(codec):
    torch.manual_seed(3)
    start = torch.randn(NUMEL)
    sent = {}
    for setting in ("none", codec):
        averagers, log = _group([A, B], anchor=start, compression=setting)
        _round(averagers, [start + 0.1 * torch.randn(NUMEL), start + 0.1 * torch.randn(NUMEL)])
        assert len(log["bytes"]) == 2 and (setting == "none") == (log["anchors"] == ["", ""])
        sent[setting] = sum(log["bytes"]) / 2
    ratio = payload_bytes(NUMEL, torch.float32, Codec.parse(codec)) / (NUMEL * 4)
    assert sent[codec] / sent["none"] == pytest.approx(ratio, abs=0.02)


def test_bfloat16_parameters_send_their_delta_in_bfloat16_and_stay_bit_identical():
    torch.manual_seed(4)
    start = torch.randn(NUMEL).to(torch.bfloat16)
    averagers, log = _group([A, B], anchor=start, compression="topk:0.5/fp16")
    local = [start + (0.1 * torch.randn(NUMEL)).to(torch.bfloat16) for _ in averagers]
    new = _round(averagers, local)
    assert torch.equal(new[0], new[1]) and new[0].dtype == torch.bfloat16 and all(log["anchors"])
    assert log["dtypes"] == [torch.bfloat16] * 2  # decoded, no larger than the parameters themselves


def test_none_pushes_the_parameters_themselves():
    averagers, log = _group([A, B], compression="none")
    x, y = torch.tensor([1.0] * NUMEL), torch.tensor([2.0] * NUMEL)
    new = _round(averagers, [x, y])
    assert log["anchors"] == ["", ""] and torch.equal(new[0], (x + y) / 2) and torch.equal(new[1], new[0])


class _Links:
    def __init__(self, bandwidth: float) -> None:
        self.bandwidth = bandwidth

    def get(self, peer: str) -> LinkEstimate:
        return LinkEstimate(self.bandwidth, 0.001, 0.0, "probe")


def test_adaptive_picks_one_codec_for_all_replicas_from_the_slowest_link_and_the_time_of_the_local_steps():
    now = [0.0]
    slow = DeltaCompression("adaptive", _Links(1e6), clock=lambda: now[0])  # 1 Mbit/s
    now[0] = 1.0  # one second of local steps since the averager began
    codec = slow.codec(1_000_000, [B, C])  # 4 MB of float32 would take 32 s
    assert codec.name == "topk" and codec.values == "int8"
    assert payload_bytes(1_000_000, torch.float32, codec) * 8 / 1e6 <= 1.0
    fast = DeltaCompression("adaptive", _Links(1e11), clock=lambda: now[0])
    now[0] = 2.0
    assert fast.codec(1_000_000, [B]).exact


def test_adaptive_choosing_none_sends_the_parameters_and_the_residual_in_full():
    now = [0.0]
    delta = DeltaCompression("adaptive", _Links(1e11), clock=lambda: now[0])
    delta.feedback.residuals["delta"] = torch.full((4,), 0.25)
    now[0] = 1.0
    anchor = torch.zeros(4)
    prepared = delta.prepare(torch.ones(4), anchor, anchor_digest(anchor), [B])
    assert prepared.anchor == "" and torch.equal(prepared.member, torch.full((4,), 1.25))
    assert not delta.feedback.residuals


def test_the_anchor_digest_travels_and_tells_anchors_apart():
    push = ParamsPush.from_bytes(ParamsPush(run_id="r", round=3, anchor="abc").to_bytes())
    assert push.anchor == "abc" and ParamsPush.from_bytes(ParamsPush(run_id="r", round=3).to_bytes()).anchor == ""
    x = torch.zeros(8)
    y = x.clone()
    y[5] = 1e-30
    assert anchor_digest(x) == anchor_digest(x.clone()) != anchor_digest(y)
    with pytest.raises(ValueError, match="compression must be"):
        DeltaCompression("topk:2")
