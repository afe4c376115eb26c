"""Link measurement on real peers (127.0.0.1): network time excludes the peer's compute, a joining peer probes the
others and publishes its links, and bad probes are refused while the peer keeps serving."""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Iterator

import pytest
import torch
from rich.console import Console

from peers.cli.launch import LocalSwarm
from peers.cli.status import print_status
from peers.client.swarm_client import SwarmClient
from peers.model import LocalModel, ModelConfig, make_tiny_model
from peers.server.block_timing import compute_key
from peers.server.probe_calls import MAX_TRANSFERS
from peers.wire.errors import RequestError
from peers.wire.messages import LinkProbe
from peers.wire.probe import PROBE_LARGEST
from swarm.measure import Compute, cached_compute


@pytest.fixture(scope="module")
def heavy_dir(tmp_path_factory):
    """Two wide blocks: a decode step costs the peer several ms of compute, more than loopback's round trip."""
    return make_tiny_model(tmp_path_factory.mktemp("models") / "llama-wide", family="llama", hidden_size=1024,
                           num_layers=2, num_heads=8, num_kv_heads=4, intermediate_size=2048, seed=3)


def _wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def test_router_holds_network_time_not_the_peers_compute(tmp_path, heavy_dir):
    """Protects the fix of the double counting: the router's RTT of a peer whose compute dominates its hop is the
    hop's wall time minus the compute the peer reports, well below the wall time the client saw."""
    with LocalSwarm(tmp_path, update_period=2.0) as swarm:
        swarm.start_dht()
        peer = swarm.start_peer(heavy_dir, block_indices="0:2")
        with SwarmClient(heavy_dir, initial_peers=swarm.initial_peers) as client:
            client.wait_for_records(1)
            client.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=16)
            state = client.router.links.links[peer.peer_id]
            walls = [wall for wall, _ in state.recent]
            computes = [compute for _, compute in state.recent]
            rtt = client.router.rtt[peer.peer_id]
            record = client.records()[0]
    assert len(walls) >= 8, "each step's reply should report the peer's compute and make a sample"
    wall, compute = statistics.median(walls), statistics.median(computes)
    assert 0 < compute < wall
    assert rtt < wall - compute / 2, f"router RTT {rtt * 1e3:.2f} ms vs hop wall {wall * 1e3:.2f} ms, compute " \
                                     f"{compute * 1e3:.2f} ms: compute leaks into the network estimate"
    assert record.forward_seconds > 0 and record.backward_seconds > 0  # measured per block, published
    assert record.throughput == pytest.approx(1 / record.forward_seconds)


@pytest.fixture
def probed_swarm(fresh_swarm, llama_dir) -> Iterator[tuple[LocalSwarm, list]]:
    procs = [fresh_swarm.start_peer(llama_dir, block_indices=span, wait=False) for span in ("0:4", "4:8")]
    for proc in procs:
        fresh_swarm.wait_ready(proc)
    yield fresh_swarm, procs


def test_a_joining_peer_probes_the_others_and_publishes_its_links(probed_swarm, llama_dir):
    swarm, others = probed_swarm
    joiner = swarm.start_peer(llama_dir, block_indices="0:8")
    with SwarmClient(llama_dir, initial_peers=swarm.initial_peers) as client:
        def joiner_links():
            record = next((r for r in client.records() if r.peer_id == joiner.peer_id), None)
            return record if record is not None and len(record.links) >= 2 else None

        record = _wait_until(joiner_links, 60, "the joiner's record to list its links")
        rows = {row.peer_id: row for row in record.links}
        assert {p.peer_id for p in others} <= rows.keys()
        for peer in others:
            row = rows[peer.peer_id]
            assert row.source == "probe" and row.bandwidth > 0 and 0 < row.rtt < 1.0 and row.age >= 0
        console = Console(width=250, record=True)
        print_status(client.model_name, client.records(), client.model_config.num_layers, console)
    text = console.export_text()
    assert f"...{others[0].peer_id[-4:]} " in text and "bit/s" in text and " ms" in text  # its best links
    assert "Link probe to" not in joiner.log()  # every probe answered
    # the tests' peers cap their probes at 1 MiB (--probe_max_mib 1, tests/conftest.py): loopback grows none
    assert LocalSwarm.probe_max_mib == 1 and joiner.log().count(" 1 MiB in ") >= 2
    assert " 4 MiB in " not in joiner.log() and " 16 MiB in " not in joiner.log()


def test_bad_probes_are_refused_and_the_peer_keeps_serving(llama_swarm, llama_client, llama_dir):
    records = llama_client.wait_for_records(2)
    peer_id = next(r.peer_id for r in records if r.start == 0)
    stream = llama_client.loop.run(llama_client.peer_stream(peer_id))

    def call(message, tensor=None):
        return llama_client.loop.run(stream.call(message, tensor, 30.0, observe=False))

    too_big = torch.zeros((PROBE_LARGEST + (1 << 20)) // 4)
    with pytest.raises(RequestError, match="a probe transfer may carry at most"):
        call(LinkProbe(transfer=True), too_big)
    with pytest.raises(RequestError, match="a transfer probe carries a tensor, a round trip none"):
        call(LinkProbe(), torch.zeros(4))
    for _ in range(MAX_TRANSFERS - 1):  # the refused one counted
        reply, _ = call(LinkProbe(transfer=True), torch.zeros(1024))
        assert reply.compute_ms > 0
    with pytest.raises(RequestError, match=f"at most {MAX_TRANSFERS} probe transfers per caller per 60 s; try again"):
        call(LinkProbe(transfer=True), torch.zeros(1024))
    for _ in range(12):
        call(LinkProbe())
    with pytest.raises(RequestError, match="at most 12 probe round trips per caller per 60 s"):
        call(LinkProbe())

    input_ids = torch.randint(0, 256, (1, 7))  # the same stream and the peer still serve
    expected, _ = LocalModel.from_dir(llama_dir)(input_ids)
    assert (llama_client.forward(input_ids) - expected).abs().max() < 1e-4
    assert not stream.closed


def test_a_block_timed_on_a_busy_machine_is_timed_again_while_idle(tmp_path, heavy_dir):
    """Protects the idle re-timing (``peers.server.retiming``): a peer whose cached block timing was taken on a busy
    machine (seeded ~1,000x slow here) times the block again once idle, announces the fast figure and caches it."""
    config = ModelConfig.from_dir(heavy_dir)
    key = compute_key(config, "cpu", "torch.float32")
    with LocalSwarm(tmp_path, update_period=1.0) as swarm:
        cache = swarm.workdir / "cache"
        cached_compute(cache, key, lambda: Compute(0.05, 0.1))  # what a peer timed while the machine was busy
        swarm.start_dht()
        peer = swarm.start_peer(heavy_dir, block_indices="0:2", extra=["--retime_every", "1"])
        with SwarmClient(heavy_dir, initial_peers=swarm.initial_peers) as client:
            client.wait_for_records(1)
            record = _wait_until(lambda: next((r for r in client.records() if r.forward_seconds < 0.005), None),
                                 30, "the record to announce the idle timing")
        peer.wait_for(re.compile(r"Timed one block again while idle: .* faster than announced"), 10)
    assert record.backward_seconds < 0.01 and record.throughput == pytest.approx(1 / record.forward_seconds)
    stored = cached_compute(cache, key, lambda: pytest.fail("the cache should hold the new timing"))
    assert stored.forward == pytest.approx(record.forward_seconds)
