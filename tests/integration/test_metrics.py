"""A peer's Prometheus metrics (``--metrics_port``), scraped during a real generation through it."""

from __future__ import annotations

import asyncio
import socket
import time
import urllib.request
from collections.abc import Iterator

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from peers.cli.launch import LocalSwarm
from peers.client.swarm_client import SwarmClient

NEW_TOKENS = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def metered(llama_dir, tmp_path_factory) -> Iterator[tuple[str, SwarmClient]]:
    port = _free_port()
    with LocalSwarm(tmp_path_factory.mktemp("metrics")) as swarm:
        swarm.start_dht()
        swarm.start_peer(llama_dir, block_indices="0:8", extra=["--metrics_port", str(port)])
        client = SwarmClient(llama_dir, initial_peers=swarm.initial_peers)
        try:
            client.wait_for_records(1)
            yield f"http://127.0.0.1:{port}/metrics", client
        finally:
            client.close()


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample: (name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_counters_follow_a_generation(metered):
    url, client = metered
    before = scrape(url)
    client_id = str(client.node.peer_id)
    during: dict = {}

    async def generate() -> int:
        tokens = 0
        async for _ in client.generate_stream(torch.tensor([[1, 2, 3, 4]]), NEW_TOKENS):
            tokens += 1
            if tokens == 2:
                during.update(await asyncio.to_thread(scrape, url))
        return tokens

    assert asyncio.run(generate()) == NEW_TOKENS
    deadline = time.monotonic() + 10  # the close needs no reply: the client does not wait for it
    while (after := scrape(url))[("fusionswarm_sessions", ())] != 0:
        assert time.monotonic() < deadline, "the session was never closed"
        time.sleep(0.1)

    def delta(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    # the prompt's step gives the first token, each later token one step more; the last token needs none
    steps = delta("fusionswarm_requests_total", kind="InferenceStep")
    assert steps == NEW_TOKENS
    assert delta("fusionswarm_requests_total", kind="InferenceOpen") == 1
    assert delta("fusionswarm_requests_total", kind="InferenceClose") == 1
    assert delta("fusionswarm_request_seconds_count", kind="InferenceStep") == steps
    assert delta("fusionswarm_request_seconds_sum", kind="InferenceStep") > 0
    assert delta("fusionswarm_refusals_total", kind="InferenceStep") == 0
    assert delta("fusionswarm_batch_rows_count", kind="inference") == steps  # alone: one batch per step
    assert delta("fusionswarm_batch_rows_sum", kind="inference") == steps
    assert delta("fusionswarm_bytes_total", direction="in", neighbour=client_id) > 0
    assert delta("fusionswarm_bytes_total", direction="out", neighbour=client_id) > 4 * 64 * steps  # a float each
    # while it ran: one session, its cache reserved; after the close: none
    assert during[("fusionswarm_sessions", ())] == 1
    assert during[("fusionswarm_cache_tokens", (("state", "used"),))] > 0
    assert after[("fusionswarm_cache_tokens", (("state", "used"),))] == 0
    assert after[("fusionswarm_cache_tokens", (("state", "free"),))] == 16384
    assert after[("fusionswarm_blocks", (("bound", "end"),))] == 8
    assert after[("fusionswarm_training_step", ())] == 0
