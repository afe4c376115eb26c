"""``unmeasured`` (the peers a client still has to probe) and ``probe_into``'s handling of peers it cannot reach."""

from __future__ import annotations

import asyncio

from peers.wire.probe import probe_into, unmeasured
from swarm.links import LinkTable


def pid(name: str) -> str:
    return "12D3KooW" + name * 44


def test_unmeasured_keeps_order_once_each_and_skips_known_bandwidths():
    table = LinkTable()
    table.observe(pid("A"), 0.002, 0.001, 1_000_000)  # a bandwidth sample: known
    table.observe(pid("B"), 0.002, 0.001, 100)  # a round trip only: still unmeasured
    names = [pid(n) for n in "CABCD"]
    assert unmeasured(table, names) == [pid("C"), pid("B"), pid("D")]


def test_probe_into_skips_peers_it_cannot_reach_and_goes_on():
    table, asked = LinkTable(), []

    async def stream_for(peer_id: str):
        asked.append(peer_id)
        raise ConnectionError("gone")

    done = asyncio.run(probe_into(table, stream_for, [pid("A"), pid("B")], timeout=1.0))
    assert done == 0 and asked == [pid("A"), pid("B")]
    assert table.get(pid("A")) is None  # nothing invented for a link that was not measured
