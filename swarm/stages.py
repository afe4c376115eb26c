"""Pick the pipeline of a training run: peers whose whole spans tile the model's blocks exactly.

A training stage is a peer's whole span (it owns those parameters and their optimizer state). Among the
tilings the swarm offers, the one with the smallest bottleneck (the slowest stage's time per token) wins:
in a pipeline with micro-batches in flight, the slowest stage sets the pace.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import cache

from swarm.records import PeerRecord, PeerState


class NoPipelineError(RuntimeError):
    """The online peers' spans cannot tile all blocks."""


def stage_seconds(record: PeerRecord) -> float:
    """Seconds per token of a peer's whole span (its throughput is tokens/s per block)."""
    return (record.end - record.start) / max(record.throughput, 1e-9)


def choose_stages(records: Sequence[PeerRecord], num_blocks: int) -> list[PeerRecord]:
    """Peers, in block order, whose spans tile ``[0, num_blocks)`` with the smallest bottleneck."""
    online = [r for r in records if r.state == PeerState.ONLINE and r.end <= num_blocks]
    by_start: dict[int, list[PeerRecord]] = {}
    for record in online:
        by_start.setdefault(record.start, []).append(record)

    @cache
    def best(position: int) -> tuple[float, tuple[PeerRecord, ...]] | None:
        if position == num_blocks:
            return 0.0, ()
        options = []
        for record in by_start.get(position, ()):
            rest = best(record.end)
            if rest is not None:
                options.append((max(stage_seconds(record), rest[0]), len(rest[1]), record.peer_id,
                                (record, *rest[1])))
        if not options:
            return None
        bottleneck, _, _, chain = min(options)
        return bottleneck, chain

    found = best(0)
    if found is None:
        spans = ", ".join(f"{r.start}:{r.end}" for r in sorted(online, key=lambda r: (r.start, r.end))) or "none"
        raise NoPipelineError(f"the online peers' spans ({spans}) do not tile blocks 0:{num_blocks}; training needs "
                              f"peers whose whole spans meet end to end (start peers with --block_indices)")
    return list(found[1])


def choose_stage_groups(records: Sequence[PeerRecord], num_blocks: int) -> list[list[PeerRecord]]:
    """Stages tiling ``[0, num_blocks)``, each with every online replica of its span (fastest first).

    Spans are weighed by their replicas' combined throughput: micro-batches are spread over replicas.
    """
    online = [r for r in records if r.state == PeerState.ONLINE and r.end <= num_blocks]
    groups: dict[tuple[int, int], list[PeerRecord]] = {}
    for record in online:
        groups.setdefault((record.start, record.end), []).append(record)
    combined = [dataclasses.replace(min(group, key=lambda r: r.peer_id), throughput=sum(r.throughput for r in group))
                for group in groups.values()]
    tiling = choose_stages(combined, num_blocks)
    return [sorted(groups[(s.start, s.end)], key=lambda r: (-r.throughput, r.peer_id)) for s in tiling]


def spread(micro_batches: int, throughputs: Sequence[float]) -> list[int]:
    """Which replica gets each of a step's micro-batches: in proportion to speed, each replica at least one
    when there are enough (the replica expected to finish first takes the next one)."""
    speeds = [max(t, 1e-9) for t in throughputs]
    counts, order = [0] * len(speeds), []
    for _ in range(micro_batches):
        replica = min(range(len(speeds)), key=lambda r: ((counts[r] + 1) / speeds[r], r))
        counts[replica] += 1
        order.append(replica)
    return order
