"""The probe's transfers grow with the link (``next_probe_bytes``, ``probe_link``): quick ones are followed by
larger ones up to a bound, a slow link gets the first only, and a larger transfer an older peer refuses ends the
probe with the reading before it. The link is simulated: a fake stream advances a fake clock."""

from __future__ import annotations

import asyncio

import pytest

from peers.wire import probe
from peers.wire.errors import RequestError
from peers.wire.messages import InferenceReply
from peers.wire.probe import PROBE_BYTES, PROBE_LARGEST, next_probe_bytes, probe_link

MIB = 1 << 20


def test_a_quick_transfer_is_followed_by_a_larger_one_up_to_the_bound():
    assert next_probe_bytes(MIB, 0.01) == 4 * MIB
    assert next_probe_bytes(4 * MIB, 0.249) == 16 * MIB
    assert next_probe_bytes(16 * MIB, 0.01) is None  # the largest is the reading
    assert next_probe_bytes(8 * MIB, 0.01) == PROBE_LARGEST  # bounded, not 32 MiB
    assert next_probe_bytes(MIB, 0.25) is None and next_probe_bytes(MIB, 1.0) is None  # long enough
    assert next_probe_bytes(MIB, float("nan")) is None  # a broken timing never grows the probe


class FakeLink:
    """A stream over a link of ``rate`` bits/s with ``fixed`` seconds per request; records the payloads sent."""

    def __init__(self, rate: float, fixed: float = 0.002, refuse_above: int | None = None) -> None:
        self.rate, self.fixed, self.refuse_above = rate, fixed, refuse_above
        self.now, self.sent, self.peer_id = 0.0, [], "12D3KooW" + "A" * 44

    def clock(self) -> float:
        return self.now

    async def call(self, message, tensor, timeout, *, observe=True):
        nbytes = 0 if tensor is None else tensor.numel() * tensor.element_size()
        if tensor is not None and self.refuse_above is not None and nbytes > self.refuse_above:
            raise RequestError("probe refused: a probe transfer may carry at most ... bytes")
        self.sent.append(nbytes)
        self.now += self.fixed + 8 * nbytes / self.rate
        return InferenceReply(compute_ms=0.1), None


def run_probe(link: FakeLink, monkeypatch) -> probe.ProbeResult:
    monkeypatch.setattr(probe.time, "perf_counter", link.clock)
    return asyncio.run(probe_link(link))  # type: ignore[arg-type]


@pytest.mark.parametrize("rate, sizes", [
    (8e6, [MIB]),  # ~1 s: the first transfer is the reading; a slow link never gets 4 or 16 MiB
    (50e6, [MIB, 4 * MIB]),  # 1 MiB ~170 ms, then 4 MiB ~670 ms
    (1e9, [MIB, 4 * MIB, 16 * MIB]),  # 8 ms, 34 ms, then the largest
])
def test_transfers_grow_with_the_link(monkeypatch, rate, sizes):
    link = FakeLink(rate)
    result = run_probe(link, monkeypatch)
    transfers = [n for n in link.sent if n]
    assert transfers == sizes and len(result.round_trips) == 3
    assert result.nbytes == sizes[-1]
    assert 8 * result.nbytes / result.transfer_wall == pytest.approx(rate, rel=0.1)  # the fixed cost amortised
    assert all(8 * n / rate <= 4 * probe.PROBE_LONG_ENOUGH for n in transfers[1:])  # a larger one follows a quick one


def test_a_larger_transfer_an_older_peer_refuses_leaves_the_reading_before_it(monkeypatch):
    link = FakeLink(1e9, refuse_above=PROBE_BYTES + (64 << 10))
    result = run_probe(link, monkeypatch)
    assert result.nbytes == PROBE_BYTES and [n for n in link.sent if n] == [PROBE_BYTES]


def test_a_refused_first_transfer_is_an_error(monkeypatch):
    with pytest.raises(RequestError, match="probe refused"):
        run_probe(FakeLink(1e9, refuse_above=1000), monkeypatch)
