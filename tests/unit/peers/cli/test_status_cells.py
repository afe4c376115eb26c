"""`swarm status`: each peer's measured compute and its best links, compactly."""

from __future__ import annotations

import pytest
from rich.console import Console

from peers.cli.status import compute_cell, links_cell, print_status
from swarm.records import LinkRow, PeerRecord, PeerState

A = "12D3KooW" + "A" * 40 + "abcd"
B = "12D3KooW" + "B" * 40 + "wxyz"
C = "12D3KooW" + "C" * 40 + "cccc"
D = "12D3KooW" + "D" * 40 + "dddd"


def rec(**changes) -> PeerRecord:
    fields = dict(peer_id=A, model="m", start=0, end=4, state=PeerState.ONLINE, throughput=100.0)
    fields.update(changes)
    return PeerRecord(**fields)


@pytest.mark.parametrize(
    "record, text",
    [
        (rec(), "-"),  # an older peer, or --throughput: nothing measured
        (rec(forward_seconds=1.25e-5, backward_seconds=3.1e-5), "0.0125 / 0.031"),
        (rec(forward_seconds=0.002), "2 / -"),
    ],
)
def test_compute_cell(record, text):
    assert compute_cell(record) == text


@pytest.mark.parametrize(
    "links, text",
    [
        ((), "-"),
        ((LinkRow(B, 95e6, 0.0012, 3.0),), "...wxyz 95 Mbit/s 1.2 ms"),
        ((LinkRow(B, 0.0, 0.0004, 3.0),), "...wxyz ? Mbit/s 0.4 ms"),  # only the round trip known
        ((LinkRow(B, 8e6, 0.05, 1.0), LinkRow(C, 2.5e9, 0.0006, 1.0), LinkRow(D, 500e3, 0.1, 1.0),
          LinkRow(A, 100e6, 0.01, 1.0, "probe")),  # the fastest 3
         "...cccc 2.5 Gbit/s 0.6 ms\n...abcd 100 Mbit/s 10.0 ms\n...wxyz 8 Mbit/s 50.0 ms"),
    ],
)
def test_links_cell(links, text):
    assert links_cell(rec(peer_id=D if any(r.peer_id == A for r in links) else A, links=links)) == text


def test_status_table_shows_compute_and_links():
    console = Console(width=250, record=True)
    records = [rec(forward_seconds=2e-5, backward_seconds=5e-5, links=(LinkRow(B, 95e6, 0.0012, 3.0),)),
               rec(peer_id=B, start=4, end=8)]
    print_status("m", records, 8, console)
    text = console.export_text()
    assert "0.02 / 0.05" in text and "...wxyz 95 Mbit/s 1.2 ms" in text and "every block is served" in text


def test_status_shows_plans_groups_stages_backups_and_version():
    from swarm.plan.types import Assignment, Group, Plan

    group = Group((Assignment(A, 0, 3), Assignment(B, 3, 8)), seconds_per_token=0.004)
    plan = Plan(model="m", num_blocks=8, version=7, groups=(group,), backups=(C,), broker=D, run_id="run-x")
    console = Console(width=250, record=True)
    records = [rec(end=3), rec(peer_id=B, start=4, end=8)]  # B has not moved to 3:8 yet
    print_status("m", records, 8, console, plans=[plan])
    text = console.export_text()
    assert "v7" in text and "...dddd" in text and "run-x" in text
    assert "...abcd 0:3 -> ...wxyz 3:8" in text and "250.0" in text and "moving" in text and "...cccc" in text
    console = Console(width=250, record=True)
    print_status("m", [rec(end=3), rec(peer_id=B, start=3, end=8)], 8, console, plans=[plan])
    assert "yes" in console.export_text()
    console = Console(width=250, record=True)
    print_status("m", records, 8, console, plans=[])
    assert "no plan published" in console.export_text()
