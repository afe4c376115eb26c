"""LinkProber: which neighbours a peer probes (online peers of its model without a recent bandwidth estimate), and
that a round whose probes fail still publishes what the peer knows."""

from __future__ import annotations

import asyncio

import pytest

import peers.server.prober as prober
from peers.server.prober import REPROBE_AGE, LinkProber
from swarm.links import LinkTable
from swarm.records import PeerRecord, PeerState

ME = "12D3KooW" + "Z" * 44


def pid(name: str) -> str:
    return "12D3KooW" + name * 44


def rec(name: str, state: PeerState = PeerState.ONLINE) -> PeerRecord:
    return PeerRecord(peer_id=pid(name), model="m", start=0, end=1, state=state, throughput=1.0)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    "records, known, age, expected",
    [
        ([rec("A"), rec("B")], {}, 0.0, ["A", "B"]),
        ([rec("A"), rec("B", PeerState.JOINING), rec("C", PeerState.OFFLINE)], {}, 0.0, ["A"]),
        ([rec("A"), rec("B")], {"A": "bandwidth"}, 0.0, ["B"]),  # a passive bandwidth is enough
        ([rec("A"), rec("B")], {"A": "rtt"}, 0.0, ["A", "B"]),  # a round trip alone is not
        ([rec("A")], {"A": "bandwidth"}, REPROBE_AGE + 1, ["A"]),  # stale: probed again
        ([rec("Z"), rec("A")], {}, 0.0, ["A"]),  # never ourselves
    ],
)
def test_targets(records, known, age, expected):
    clock = Clock()
    table = LinkTable(clock)
    for name, what in known.items():
        table.observe(pid(name), 0.002, 0.001, 100 if what == "rtt" else 1_000_000)
    clock.now += age
    probing = LinkProber(table, None, None, ME, lambda rows, wake: None)  # type: ignore[arg-type]
    assert probing.targets(records) == [pid(n) for n in expected]


def test_targets_are_bounded(monkeypatch):
    monkeypatch.setattr(prober, "MAX_PROBES_PER_ROUND", 3)
    probing = LinkProber(LinkTable(), None, None, ME, lambda rows, wake: None)  # type: ignore[arg-type]
    assert len(probing.targets([rec(n) for n in "ABCDEFGH"])) == 3


def test_a_round_whose_probes_fail_publishes_what_is_known():
    table = LinkTable(Clock())
    table.observe(pid("A"), 0.002, 0.001, 100)
    published = []

    async def fetch():
        return [rec("A"), rec("B")]

    async def unreachable(peer_id: str):
        raise ConnectionError(f"{peer_id} is gone")

    probing = LinkProber(table, unreachable, fetch, ME, lambda rows, wake: published.append((rows, wake)))
    assert asyncio.run(probing.round()) == 0
    assert published == [(table.best_rows(), False)] and published[0][0][0].peer_id == pid("A")
