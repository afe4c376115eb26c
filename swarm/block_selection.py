"""Which blocks a joining peer should serve: the window that the swarm serves least. Pure."""

from __future__ import annotations

from collections.abc import Iterable

from swarm.records import PeerRecord, PeerState

_SERVING = (PeerState.ONLINE, PeerState.JOINING)


def block_throughputs(records: Iterable[PeerRecord], total_blocks: int) -> list[float]:
    """Sum of the throughput of serving peers, per block. A peer with unknown (0) throughput counts as 1."""
    per_block = [0.0] * total_blocks
    for record in records:
        if record.state not in _SERVING:
            continue
        for block in range(record.start, min(record.end, total_blocks)):
            per_block[block] += record.throughput if record.throughput > 0 else 1.0
    return per_block


def choose_blocks(records: Iterable[PeerRecord], total_blocks: int, num_blocks: int) -> tuple[int, int]:
    """The ``[start, end)`` window of ``num_blocks`` whose served throughput is smallest.

    Windows are compared by their sorted per-block throughputs (lexicographically), so a window that
    contains an unserved block always wins, then the one whose weakest blocks are weakest; ties go to
    the leftmost window so that the first blocks fill up first.
    """
    if not 1 <= num_blocks <= total_blocks:
        raise ValueError(f"num_blocks must be in 1..{total_blocks}, got {num_blocks}")
    per_block = block_throughputs(records, total_blocks)
    windows = range(total_blocks - num_blocks + 1)
    best = min(windows, key=lambda s: (sorted(per_block[s : s + num_blocks]), s))
    return best, best + num_blocks


def missing_blocks(records: Iterable[PeerRecord], total_blocks: int) -> list[int]:
    """Blocks that no online peer serves."""
    online = [r for r in records if r.state == PeerState.ONLINE]
    per_block = block_throughputs(online, total_blocks)
    return [i for i, t in enumerate(per_block) if t == 0]
