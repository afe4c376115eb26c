"""Estimator inputs priced from peer records: compute from a record, links from link tables or the defaults."""

from __future__ import annotations

import pytest

from privacy.identity import Identity
from privacy.peer_ids import peer_id_of
from swarm.estimator import CLIENT, ModelShape, estimate_inference
from swarm.estimator.from_records import compute_of, link_of, pipeline_from_records
from swarm.links import DEFAULT_BANDWIDTH, DEFAULT_RTT
from swarm.records import BACKWARD_RATIO, DEFAULT_SECONDS_PER_BLOCK, LinkRow, PeerRecord, PeerState

IDS = {name: peer_id_of(Identity.generate().public_bytes) for name in "AB"}


def record(name: str, start: int, end: int, *, rows: tuple[LinkRow, ...] = (), throughput: float = 0.0,
           forward: float = 0.0, backward: float = 0.0) -> PeerRecord:
    return PeerRecord(peer_id=IDS[name], model="m", start=start, end=end, state=PeerState.ONLINE,
                      throughput=throughput, forward_seconds=forward, backward_seconds=backward, links=rows)


@pytest.mark.parametrize(
    "kwargs, forward, backward",
    [
        (dict(forward=0.002, backward=0.005), 0.002, 0.005),  # measured
        (dict(forward=0.002), 0.002, 0.002 * BACKWARD_RATIO),  # backward not measured
        (dict(throughput=250.0), 0.004, 0.004 * BACKWARD_RATIO),  # an older peer: throughput only
        ({}, DEFAULT_SECONDS_PER_BLOCK, DEFAULT_SECONDS_PER_BLOCK * BACKWARD_RATIO),  # nothing: conservative
    ],
)
def test_compute_of_a_record(kwargs, forward, backward):
    compute = compute_of(record("A", 0, 1, **kwargs))
    assert compute.forward_s == pytest.approx(forward)
    assert compute.backward_s == pytest.approx(backward)


def test_a_measured_link_is_used_and_an_unknown_one_gets_the_defaults():
    rows = (LinkRow(IDS["B"], 1e8, 0.004, 2.0, "probe"),)
    records = [record("A", 0, 2, rows=rows, forward=0.001), record("B", 2, 4, forward=0.001)]
    measured = link_of(IDS["A"], IDS["B"], records)
    assert (measured.bandwidth, measured.latency) == (1e8, pytest.approx(0.002))
    reverse = link_of(IDS["B"], IDS["A"], records)  # only A -> B known: taken as symmetric
    assert reverse.bandwidth == 1e8
    unknown = link_of(CLIENT, IDS["A"], records)
    assert (unknown.bandwidth, unknown.latency) == (DEFAULT_BANDWIDTH, pytest.approx(DEFAULT_RTT / 2))


def test_a_pipeline_of_records_is_priced_and_a_faster_link_costs_less():
    slow = [record("A", 0, 2, forward=0.001), record("B", 2, 4, forward=0.001)]
    rows = (LinkRow(IDS["B"], 1e9, 0.0005, 1.0, "probe"),)
    fast = [record("A", 0, 2, rows=rows, forward=0.001), record("B", 2, 4, forward=0.001)]
    spans = [(IDS["A"], 0, 2), (IDS["B"], 2, 4)]
    model = ModelShape(hidden_size=1024, num_blocks=4)
    on_defaults = estimate_inference(model, pipeline_from_records(spans, slow, topology="chain"), batch=1, tokens=1)
    measured = estimate_inference(model, pipeline_from_records(spans, fast, topology="chain"), batch=1, tokens=1)
    assert measured.token_latency_s < on_defaults.token_latency_s
    star = pipeline_from_records(spans, slow)
    assert set(star.hops()) == {(CLIENT, IDS["A"]), (IDS["A"], CLIENT), (CLIENT, IDS["B"]), (IDS["B"], CLIENT)}


def test_a_peer_without_a_record_is_named():
    with pytest.raises(KeyError, match="no record for peer"):
        pipeline_from_records([(IDS["A"], 0, 2)], [record("B", 0, 2)])
