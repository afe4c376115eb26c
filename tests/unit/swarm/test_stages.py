"""Choosing a training pipeline: whole spans that tile the model, replicas grouped, micro-batches spread."""

from __future__ import annotations

import pytest

from swarm.records import PeerRecord, PeerState
from swarm.stages import NoPipelineError, choose_stage_groups, choose_stages, spread

IDS = [f"12D3KooW{'A' * 43}{c}" for c in "BCDEFGH"]


def _record(i: int, start: int, end: int, throughput: float = 100.0, state=PeerState.ONLINE) -> PeerRecord:
    return PeerRecord(peer_id=IDS[i], model="m", start=start, end=end, state=state, throughput=throughput)


def test_tiles_with_whole_spans_and_prefers_the_smaller_bottleneck():
    records = [_record(0, 0, 4), _record(1, 4, 8), _record(2, 0, 6, throughput=1000), _record(3, 6, 8)]
    chosen = choose_stages(records, 8)
    assert [(r.start, r.end) for r in chosen] == [(0, 6), (6, 8)]  # 6/1000 + 2/100 beats 4/100 twice


def test_overlapping_spans_that_do_not_meet_end_to_end_are_refused():
    with pytest.raises(NoPipelineError, match="do not tile blocks 0:8"):
        choose_stages([_record(0, 0, 5), _record(1, 4, 8)], 8)


def test_offline_and_joining_peers_are_not_used():
    with pytest.raises(NoPipelineError):
        choose_stages([_record(0, 0, 4), _record(1, 4, 8, state=PeerState.JOINING)], 8)


def test_replicas_of_a_span_form_one_stage_fastest_first():
    records = [_record(0, 0, 4), _record(1, 4, 8, 50), _record(2, 4, 8, 200)]
    groups = choose_stage_groups(records, 8)
    assert [[r.peer_id for r in g] for g in groups] == [[IDS[0]], [IDS[2], IDS[1]]]


def test_spread_follows_speed_and_gives_everyone_a_share():
    assert spread(4, [100, 100]) == [0, 1, 0, 1]
    order = spread(8, [300, 100])
    assert order.count(0) == 6 and order.count(1) == 2
    assert spread(3, [1.0]) == [0, 0, 0]
