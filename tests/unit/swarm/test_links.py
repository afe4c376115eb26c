"""swarm.links: the outlier-resistant EMA, network time from a reply's reported compute, the link table (round trip
and bandwidth samples, probes, the rows a record publishes) and ``link_between``."""

from __future__ import annotations

import math

import pytest

import swarm.links as links
from swarm.links import (
    DEFAULT_BANDWIDTH,
    DEFAULT_LINK,
    DEFAULT_RTT,
    LARGE_BYTES,
    SMALL_BYTES,
    LinkEstimate,
    LinkTable,
    RobustEma,
    link_between,
    network_time,
)
from swarm.records import MAX_LINKS, LinkRow, PeerRecord, PeerState


def pid(name: str) -> str:
    return "12D3KooW" + name * 44


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def ema_of(samples: list[float]) -> float:
    ema = RobustEma()
    for sample in samples:
        ema.add(sample)
    assert ema.value is not None
    return ema.value


W = [0.01] * links.WINDOW  # enough samples for the EMA to take over from the median


@pytest.mark.parametrize(
    "samples, expected",
    [
        ([0.01], 0.01),
        ([0.01] * 10, 0.01),
        ([0.01, 0.02], 0.015),  # the first samples: their median
        ([0.05, 0.001, 0.001], 0.001),  # a fresh connection's slow first round trip does not stick
        ([0.01, 0.011, 0.012, 0.5], 0.0115),
        (W + [0.02], 0.8 * 0.01 + 0.2 * 0.02),  # then an EMA, within the clip
        (W + [0.011, 0.012], 0.8 * (0.8 * 0.01 + 0.2 * 0.011) + 0.2 * 0.012),
        (W + [10.0], 0.8 * 0.01 + 0.2 * 0.02),  # one outlier 1000x: clipped to 2x the median
        (W + [0.0], 0.8 * 0.01 + 0.2 * 0.005),  # one 0 (a peer over-reporting compute): to median / 2
    ],
)
def test_robust_ema(samples, expected):
    assert ema_of(samples) == pytest.approx(expected)


def test_one_outlier_moves_the_estimate_by_at_most_a_fifth():
    base = ema_of([0.01] * 20)
    assert ema_of([0.01] * 20 + [1e6]) <= base * (1 + links.ALPHA * (links.CLIP - 1)) + 1e-15
    assert ema_of([0.01] * 20 + [1e6, 0.01, 0.01, 0.01]) < base * 1.15  # and it fades


def test_a_real_change_of_the_link_is_followed():
    """A link that becomes 10x slower (or faster): after 30 samples the estimate is within 10% of the new value."""
    assert ema_of([0.01] * 20 + [0.1] * 30) == pytest.approx(0.1, rel=0.1)
    assert ema_of([0.1] * 20 + [0.01] * 30) == pytest.approx(0.01, rel=0.1)


@pytest.mark.parametrize(
    "wall, compute, expected",
    [
        (0.01, 0.0, 0.01),
        (0.01, 0.004, 0.006),
        (0.01, 0.01, 0.0),
        (0.01, 5.0, 0.0),  # never trusted beyond the wall time
        (0.0, 0.0, 0.0),
        (0.01, -0.001, None),
        (0.01, math.nan, None),
        (0.01, math.inf, None),
        (math.nan, 0.0, None),
        (-1.0, 0.0, None),
        (0.01, True, None),
        (0.01, "0.001", None),
    ],
)
def test_network_time(wall, compute, expected):
    result = network_time(wall, compute)
    assert result == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize(
    "wall, compute, nbytes, rtt, bandwidth",
    [
        (0.003, 0.002, 100, 0.001, None),  # small: a round trip sample
        (0.003, 0.002, SMALL_BYTES - 1, 0.001, None),
        (0.003, 0.002, SMALL_BYTES, None, None),  # mid-sized: neither
        (0.003, 0.002, LARGE_BYTES - 1, None, None),
        (0.102, 0.002, 1_000_000, None, 8e6 / 0.1),  # large, no round trip known yet: all network time is transfer
        (0.003, 0.003, 1_000_000, None, None),  # a transfer too short to say anything
        (0.003, math.nan, 100, None, None),  # invalid reports make no sample
        (0.003, -1.0, 100, None, None),
        (0.003, 0.0, -5, None, None),
    ],
)
def test_observe_classifies_samples(wall, compute, nbytes, rtt, bandwidth):
    table = LinkTable()
    made = table.observe(pid("A"), wall, compute, nbytes)
    assert made == (rtt is not None or bandwidth is not None)
    state = table.links.get(pid("A"))
    assert (state.rtt.value if state else None) == (None if rtt is None else pytest.approx(rtt))
    assert (state.bandwidth.value if state else None) == (None if bandwidth is None else pytest.approx(bandwidth))


def test_bandwidth_subtracts_the_known_round_trip():
    table = LinkTable()
    table.observe(pid("A"), 0.012, 0.002, 200)  # round trip 10 ms
    table.observe(pid("A"), 0.112, 0.002, 1_250_000)  # 110 ms of network: 100 ms of transfer
    estimate = table.get(pid("A"))
    assert estimate.rtt == pytest.approx(0.01) and estimate.bandwidth == pytest.approx(1e8)
    assert estimate.bandwidth_known and estimate.source == "passive"


def test_probe_samples_are_marked_as_probe():
    clock = Clock()
    table = LinkTable(clock)
    table.observe_probe(pid("A"), [0.001, 0.001, 0.001], 1 << 20, 0.001 + 0.008, 0.0)
    estimate = table.get(pid("A"))
    assert estimate == LinkEstimate(8 * (1 << 20) / 0.008, 0.001, 0.0, "probe", probed=8 * (1 << 20) / 0.008)
    clock.now += 30
    assert table.get(pid("A")).age == pytest.approx(30)


def test_capacity_is_a_recent_probe_when_passive_samples_read_less():
    """Passive samples of a link busy both ways under-read it (replies wait behind the other direction's traffic):
    the codec choice uses ``capacity``, the larger of the estimate and a probe's reading of the last 10 minutes."""
    clock = Clock()
    table = LinkTable(clock)
    table.observe_probe(pid("A"), [0.001], 1 << 20, 0.001 + 1.0, 0.0)  # 8.4 Mbit/s, read idle
    for _ in range(12):
        clock.now += 1
        table.observe(pid("A"), 0.001 + 1.0, 0.0, (1 << 20) // 2)  # 4.2 Mbit/s: replies delayed
    estimate = table.get(pid("A"))
    assert estimate.bandwidth < 5e6 and estimate.capacity == pytest.approx(8 * (1 << 20))
    clock.now += links.PROBE_TRUST_AGE
    assert table.get(pid("A")).capacity == table.get(pid("A")).bandwidth < 5e6  # an old probe no longer counts


def test_get_fills_an_unmeasured_bandwidth_with_the_default():
    table = LinkTable()
    table.observe(pid("A"), 0.002, 0.001, 100)
    estimate = table.get(pid("A"))
    assert estimate.bandwidth == DEFAULT_BANDWIDTH and not estimate.bandwidth_known
    assert table.get(pid("B")) is None
    assert table.rtts() == {pid("A"): pytest.approx(0.001)}


def test_best_rows_are_the_freshest_at_most_max_links():
    clock = Clock()
    table = LinkTable(clock)
    names = "ABCDEFGHJK"
    for name in names:
        clock.now += 1
        table.observe(pid(name), 0.002, 0.001, 100)
    table.observe(pid("K"), 0.5, 0.0, 1_000_000)  # K: also a bandwidth
    rows = table.best_rows()
    assert len(rows) == MAX_LINKS
    assert [r.peer_id for r in rows] == [pid(n) for n in reversed(names)][:MAX_LINKS]
    assert rows[0].bandwidth > 0 and all(r.bandwidth == 0 for r in rows[1:])  # 0: only the round trip is known
    assert rows[-1].age == pytest.approx(7.0)
    PeerRecord(peer_id=pid("Z"), model="m", start=0, end=1, state=PeerState.ONLINE, throughput=1.0, links=rows)


def test_best_rows_stay_within_the_records_bounds():
    table = LinkTable()
    table.observe(pid("A"), 1e9, 0.0, 100)  # a round trip beyond MAX_RTT
    table.observe(pid("B"), 1e-4 + 1e-12, 0.0, 1 << 40)  # a bandwidth beyond MAX_BANDWIDTH
    rows = {row.peer_id: row for row in table.best_rows()}  # LinkRow validates: no ValueError
    assert rows[pid("A")].rtt == 600.0 and rows[pid("B")].bandwidth == 1e13


def test_the_table_forgets_its_oldest_neighbours(monkeypatch):
    monkeypatch.setattr(links, "MAX_NEIGHBOURS", 3)
    clock = Clock()
    table = LinkTable(clock)
    for name in "ABCD":
        clock.now += 1
        table.observe(pid(name), 0.002, 0.0, 100)
    assert set(table.links) == {pid("B"), pid("C"), pid("D")}


def record(name: str, rows: tuple[LinkRow, ...] = ()) -> PeerRecord:
    return PeerRecord(peer_id=pid(name), model="m", start=0, end=1, state=PeerState.ONLINE, throughput=1.0,
                      links=rows)


AB = LinkRow(pid("B"), 1e8, 0.004, 12.0, "probe")
BA = LinkRow(pid("A"), 5e7, 0.006, 3.0, "passive")
AB_RTT_ONLY = LinkRow(pid("B"), 0.0, 0.004, 1.0, "passive")


@pytest.mark.parametrize(
    "a, b, records, local, expected",
    [
        ("A", "B", [record("A", (AB,))], None, LinkEstimate(1e8, 0.004, 12.0, "probe")),
        ("A", "B", [record("A", (AB,)), record("B", (BA,))], None, LinkEstimate(1e8, 0.004, 12.0, "probe")),
        ("A", "B", [record("A"), record("B", (BA,))], None,  # only b -> a known: taken as symmetric
         LinkEstimate(5e7, 0.006, 3.0, "passive", reverse=True)),
        ("A", "B", [record("A", (AB_RTT_ONLY,))], None,
         LinkEstimate(DEFAULT_BANDWIDTH, 0.004, 1.0, "passive", bandwidth_known=False)),
        ("A", "B", [record("A"), record("B")], None, DEFAULT_LINK),
        ("A", "B", [], None, DEFAULT_LINK),
        ("A", "C", [record("A", (AB,))], None, DEFAULT_LINK),
        # our own table wins for our links, and answers for links to us
        ("Z", "B", [record("Z", (LinkRow(pid("B"), 1.0, 1.0, 1.0),))], "B",
         LinkEstimate(8e6, 0.5, 0.0, "probe", probed=8e6)),
        ("B", "Z", [], "B", LinkEstimate(8e6, 0.5, 0.0, "probe", reverse=True, probed=8e6)),
        # a link taken as symmetric is no faster than the fastest link its sender measured out of it (an upload)
        ("B", "A", [record("A", (AB,)), record("B", (LinkRow(pid("C"), 2e7, 0.01, 1.0, "probe"),))], None,
         LinkEstimate(2e7, 0.004, 12.0, "probe", reverse=True)),
        ("B", "A", [record("A", (AB,)), record("B", (LinkRow(pid("C"), 3e8, 0.01, 1.0, "probe"),))], None,
         LinkEstimate(1e8, 0.004, 12.0, "probe", reverse=True)),  # a faster upload: the measured rate stands
        ("B", "Z", [record("B", (LinkRow(pid("C"), 2e6, 0.01, 1.0, "probe"), AB_RTT_ONLY))], "B",
         LinkEstimate(2e6, 0.5, 0.0, "probe", reverse=True, probed=2e6)),
    ],
)
def test_link_between(a, b, records, local, expected):
    table, clock = None, Clock()
    if local is not None:
        table = LinkTable(clock)
        table.observe_probe(pid(local), [0.5], 1_000_000, 1.5)
    assert link_between(pid(a), pid(b), records, table, local_id=pid("Z")) == expected


def test_default_link_is_conservative():
    assert DEFAULT_LINK.rtt == DEFAULT_RTT >= 0.01 and DEFAULT_LINK.bandwidth == DEFAULT_BANDWIDTH <= 1e8
    assert DEFAULT_LINK.source == "default" and DEFAULT_LINK.age == math.inf
    assert DEFAULT_LINK.transfer_time(1_250_000) == pytest.approx(DEFAULT_RTT / 2 + 1.0)
