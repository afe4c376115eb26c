"""choose_blocks / missing_blocks / block_throughputs on hand-made swarms."""

from __future__ import annotations

import pytest

from swarm.block_selection import block_throughputs, choose_blocks, missing_blocks
from swarm.records import PeerRecord, PeerState

ON, JOIN, OFF, BACK = PeerState.ONLINE, PeerState.JOINING, PeerState.OFFLINE, PeerState.BACKUP


def rec(name: str, start: int, end: int, throughput: float = 1.0, state: PeerState = ON) -> PeerRecord:
    return PeerRecord(peer_id="12D3KooW" + name * 44, model="m", start=start, end=end, state=state,
                      throughput=throughput)


@pytest.mark.parametrize(
    "records, total, num, expected",
    [
        # an empty swarm fills from block 0
        ([], 8, 8, (0, 8)),
        ([], 8, 3, (0, 3)),
        ([], 1, 1, (0, 1)),
        # the next peer continues where the first stops
        ([rec("A", 0, 4)], 8, 4, (4, 8)),
        ([rec("A", 0, 4)], 8, 2, (4, 6)),
        # a gap in the middle is chosen
        ([rec("A", 0, 3), rec("B", 5, 8)], 8, 2, (3, 5)),
        ([rec("A", 0, 3), rec("B", 5, 8)], 8, 3, (2, 5)),  # ties between windows with the gap: leftmost
        ([rec("A", 0, 3), rec("B", 4, 8)], 8, 1, (3, 4)),
        ([rec("A", 0, 3, 1000.0), rec("B", 4, 8, 1000.0)], 8, 4, (0, 4)),  # contains the unserved block 3
        # the window with the least throughput
        ([rec("A", 0, 4, 10.0), rec("B", 4, 8, 1.0)], 8, 4, (4, 8)),
        ([rec("A", 0, 4, 1.0), rec("B", 4, 8, 10.0)], 8, 4, (0, 4)),
        ([rec("A", 0, 4, 10.0), rec("B", 4, 8, 1.0)], 8, 2, (4, 6)),
        ([rec("A", 0, 8, 5.0), rec("B", 2, 4, 5.0), rec("C", 6, 8, 5.0)], 8, 2, (0, 2)),
        ([rec("A", 0, 8, 5.0), rec("B", 0, 4, 5.0), rec("C", 6, 8, 5.0)], 8, 2, (4, 6)),
        ([rec("A", 0, 8, 5.0), rec("B", 0, 4, 5.0), rec("C", 6, 8, 5.0)], 8, 3, (3, 6)),
        # joining peers count (they will serve soon), with unknown (0) throughput counted as 1
        ([rec("A", 0, 4, 1.0), rec("B", 4, 8, 5.0, JOIN)], 8, 4, (0, 4)),
        ([rec("A", 0, 4, 0.5), rec("B", 4, 8, 0.0, JOIN)], 8, 4, (0, 4)),
        ([rec("A", 0, 4, 2.0), rec("B", 4, 8, 0.0, JOIN)], 8, 4, (4, 8)),
        # offline and backup peers serve nothing
        ([rec("A", 0, 4, 1.0), rec("B", 4, 8, 100.0, OFF)], 8, 4, (4, 8)),
        ([rec("A", 0, 4, 1.0), rec("B", 4, 8, 100.0, BACK)], 8, 4, (4, 8)),
        ([rec("A", 0, 8, 100.0, OFF), rec("B", 0, 8, 100.0, BACK)], 8, 3, (0, 3)),
        # a record reaching past the model's end is clipped, not an error
        ([rec("A", 0, 12)], 8, 4, (0, 4)),
        ([rec("A", 4, 12)], 8, 4, (0, 4)),
    ],
)
def test_choose_blocks(records, total, num, expected):
    assert choose_blocks(records, total, num) == expected


@pytest.mark.parametrize("total, num", [(8, 0), (8, -1), (8, 9), (1, 2), (0, 1)])
def test_choose_blocks_num_out_of_range(total, num):
    with pytest.raises(ValueError, match="num_blocks must be in"):
        choose_blocks([], total, num)


def test_choose_blocks_accepts_a_generator():
    assert choose_blocks((r for r in [rec("A", 0, 4)]), 8, 4) == (4, 8)


@pytest.mark.parametrize(
    "records, total, expected",
    [
        ([], 4, [0.0, 0.0, 0.0, 0.0]),
        ([rec("A", 0, 2, 3.0), rec("B", 1, 4, 2.0)], 4, [3.0, 5.0, 2.0, 2.0]),
        ([rec("A", 0, 4, 0.0)], 4, [1.0, 1.0, 1.0, 1.0]),
        ([rec("A", 0, 4, 7.0, JOIN), rec("B", 0, 4, 9.0, OFF), rec("C", 0, 4, 9.0, BACK)], 4, [7.0] * 4),
        ([rec("A", 2, 10, 1.0)], 4, [0.0, 0.0, 1.0, 1.0]),
    ],
)
def test_block_throughputs(records, total, expected):
    assert block_throughputs(records, total) == expected


@pytest.mark.parametrize(
    "records, total, expected",
    [
        ([], 4, [0, 1, 2, 3]),
        ([rec("A", 0, 8)], 8, []),
        ([rec("A", 0, 3), rec("B", 5, 8)], 8, [3, 4]),
        ([rec("A", 1, 2), rec("B", 3, 4)], 5, [0, 2, 4]),
        ([rec("A", 0, 8, 0.0)], 8, []),  # unknown throughput still serves
        ([rec("A", 0, 8, 5.0, JOIN)], 4, [0, 1, 2, 3]),  # not serving yet
        ([rec("A", 0, 4, 5.0, OFF), rec("B", 0, 2, 5.0, BACK)], 4, [0, 1, 2, 3]),
        ([rec("A", 0, 2), rec("B", 0, 4, 5.0, OFF)], 4, [2, 3]),
    ],
)
def test_missing_blocks(records, total, expected):
    assert missing_blocks(records, total) == expected
