"""Which graph peers a ``GraphTrainer`` trains on (``choose_stages``), and how ``swarm peer --graph`` reads its
config flags: a tiling of the graph's nodes by online records, or a message saying what to start."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from peers.cli.graph_peer import key_values, link_rates, node_range, stage_index
from peers.trainer.graph_trainer import choose_stages
from swarm.records import PeerRecord, PeerState

GRAPH = SimpleNamespace(arch="resnet18", order=tuple(range(69)))


def _record(i: int, start: int, end: int, state: PeerState = PeerState.ONLINE) -> PeerRecord:
    return PeerRecord(peer_id=f"12D3KooW{'A' * 43}{i}", model="resnet18-0123456789ab", start=start, end=end,
                      state=state, throughput=1.0)


def test_stages_tile_the_graph_with_online_peers():
    records = [_record(1, 0, 23), _record(2, 23, 46), _record(3, 46, 69), _record(4, 23, 46, PeerState.OFFLINE),
               _record(5, 0, 10)]
    chain = choose_stages(records, GRAPH)  # type: ignore[arg-type]
    assert [(start, end) for _, start, end in chain] == [(0, 23), (23, 46), (46, 69)]


def test_a_gap_says_what_to_start():
    with pytest.raises(ValueError, match=r"no peer serves nodes from 23 of resnet18's 69 \(served: 0:23, 46:69\).*"
                                         r"--graph resnet18 --graph_nodes 23:END"):
        choose_stages([_record(1, 0, 23), _record(3, 46, 69)], GRAPH)  # type: ignore[arg-type]


def test_config_flags_take_json_or_key_values():
    assert key_values('{"num_classes": 10}') == {"num_classes": 10}
    assert key_values("batch=8,image_size=64,zero_init_residual=true,name=x") == {
        "batch": 8, "image_size": 64, "zero_init_residual": True, "name": "x"}
    assert node_range("3:40") == (3, 40) and stage_index("1/3") == (1, 3)
    assert link_rates("100,8") == (12.5e6, 1e6)  # Mbit/s -> bytes/s
    for bad, parse in (("[1]", key_values), ("batch", key_values), ("3-40", node_range), ("3/3", stage_index),
                       ("100,x", link_rates), ("100,0", link_rates)):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)
