"""The monitor's data (``peers.monitor.snapshot``) and page (``peers.monitor.page``) from records, no network."""

from __future__ import annotations

import json

from peers.monitor.page import page
from peers.monitor.snapshot import OnlineSince, access_note, model_view, ranges, swarm_state, swarm_tokens_per_s
from swarm.records import LinkRow, PeerRecord, PeerState

IDS = [f"12D3KooW{c * 44}" for c in "ABCD"]


def _record(i: int, start: int, end: int, state=PeerState.ONLINE, **kw) -> PeerRecord:
    return PeerRecord(peer_id=IDS[i], model="m", start=start, end=end, state=state, throughput=100.0,
                      forward_seconds=0.01, addresses=("/ip4/10.0.0.1/tcp/1",), **kw)


def test_coverage_missing_and_throughput():
    records = [_record(0, 0, 2), _record(1, 0, 4), _record(2, 6, 8), _record(3, 0, 3, PeerState.BACKUP)]
    view = model_view("m", records, [], 8, since={IDS[0]: 5.0})
    assert view["coverage"] == [2, 2, 1, 1, 0, 0, 1, 1]  # the backup serves nothing
    assert view["missing"] == [[4, 6]] and view["tokens_per_s"] == 0
    assert view["backups"] == [IDS[3]] and view["online"] == 3
    assert [p["peer_id"] for p in view["peers"]][-1] == IDS[3]  # backups last
    assert view["peers"][0]["online_since"] == 5.0


def test_swarm_throughput_is_the_weakest_block():
    # 0:2 at 10 ms per block: 50 tokens/s through each of its blocks; 2:4 twice (25 + 25)
    records = [_record(0, 0, 2), _record(1, 2, 4), _record(2, 2, 4)]
    assert swarm_tokens_per_s(records, 4) == 50.0
    assert swarm_tokens_per_s([_record(0, 0, 1), _record(1, 1, 4)], 4) == 100.0 / 3


def test_no_secrets_and_escaped_names():
    records = [_record(0, 0, 2, public_name="<script>alert(1)</script>",
                       links=(LinkRow(IDS[1], 1e8, 0.001, 1.0),), cache_tokens=100, cache_used=10)]
    state = swarm_state([model_view("m", records, [], 2, since={})], private=True, refresh=2.0)
    text = json.dumps(state)
    assert "/ip4/" not in text  # addresses stay in the DHT
    assert state["access"] == "private swarm: showing what these credentials can read"
    assert state["models"][0]["peers"][0]["cache"] == {"tokens": 100, "used": 10}
    html = page(state)
    assert "<script>alert" not in html and "&lt;script&gt;" in html
    assert "every block is served" in html


def test_access_notes_and_ranges():
    assert access_note(False, 0) == "public swarm"
    assert "--private" in access_note(False, 3)
    assert ranges([0, 1, 2, 5, 7, 8]) == [[0, 3], [5, 6], [7, 9]]


def test_online_since_restarts_after_a_gap():
    since = OnlineSince()
    assert since.update([_record(0, 0, 2)], 1.0) == {IDS[0]: 1.0}
    assert since.update([_record(0, 0, 2)], 2.0) == {IDS[0]: 1.0}
    assert since.update([], 3.0) == {}
    assert since.update([_record(0, 0, 2, PeerState.JOINING)], 4.0) == {}
    assert since.update([_record(0, 0, 2)], 5.0) == {IDS[0]: 5.0}
