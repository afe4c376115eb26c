"""``swarm monitor`` on a real swarm: 3 peers of the tiny Llama (blocks 0:2, 2:4, 6:8; 4:6 missing), its JSON, and
its page in a real headless Chromium, which sees a killed peer go."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from peers.cli.launch import LocalSwarm, SwarmProcess
from tests.integration.chromium import Chromium, chromium_binary

UPDATE_PERIOD = 1.0  # peers' announcements: a killed peer's record lives 2 x 1 + 1 = 3 s (``Announcer.ttl``)
REFRESH = 1.0  # the monitor's reading of the DHT, and its page's refresh
SPANS = ("0:2", "2:4", "6:8")


@pytest.fixture(scope="module")
def monitored(llama_dir, tmp_path_factory) -> Iterator[tuple[LocalSwarm, list[SwarmProcess], str]]:
    with LocalSwarm(tmp_path_factory.mktemp("monitor"), update_period=UPDATE_PERIOD) as swarm:
        swarm.start_dht()
        peers = [swarm.start_peer(llama_dir, block_indices=span, wait=False, name=f"peer{span[0]}",
                                  extra=["--public_name", f"p{span.replace(':', '-')}"]) for span in SPANS]
        for proc in peers:
            swarm.wait_ready(proc)
        _, url = swarm.start_monitor([llama_dir], refresh=REFRESH)
        yield swarm, peers, url


def _state(url: str) -> dict:
    with urllib.request.urlopen(url + "api/state", timeout=10) as reply:
        assert reply.headers["Content-Type"].startswith("application/json")
        return json.load(reply)


def _wait_state(url: str, ok, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while not ok(state := _state(url)):
        assert time.monotonic() < deadline, f"the monitor's state never got there: {json.dumps(state)[:2000]}"
        time.sleep(0.3)
    return state


def test_json_endpoint(monitored):
    swarm, peers, url = monitored
    state = _wait_state(url, lambda s: s["models"][0]["online"] == 3
                        and all(p["cache"] for p in s["models"][0]["peers"]))
    model = state["models"][0]
    assert state["access"] == "public swarm" and state["refresh_s"] == REFRESH
    assert model["model"] == "llama-tiny" and model["num_blocks"] == 8
    assert model["coverage"] == [1, 1, 1, 1, 0, 0, 1, 1]
    assert model["missing"] == [[4, 6]]
    assert model["tokens_per_s"] == 0  # a missing block carries nothing
    assert {(p["start"], p["end"]) for p in model["peers"]} == {(0, 2), (2, 4), (6, 8)}
    assert {p["peer_id"] for p in model["peers"]} == {p.peer_id for p in peers}
    for p in model["peers"]:
        assert p["state"] == "online" and p["name"].startswith("p") and p["forward_ms"] > 0
        assert p["cache"] == {"tokens": 16384, "used": 0} and p["online_since"] <= time.time()
        assert p["version"]
    assert "addresses" not in json.dumps(state)  # no addresses, keys or certificates are served


@pytest.mark.skipif(chromium_binary() is None, reason="no chromium binary: `apt-get install chromium` (Debian) or "
                                                     "`make system-deps` as root")
def test_page_in_chromium(monitored, tmp_path):
    swarm, peers, url = monitored
    _wait_state(url, lambda s: s["models"][0]["online"] == 3)
    gone = asyncio.run(_browse(url, peers, tmp_path))
    # a SIGKILLed peer's record outlives it by up to its ttl (3 s), then the monitor's next reading and the page's
    # next refresh (1 s each) show it gone; the bound allows for DHT lookups on a loaded machine
    assert gone < 3 + 2 * REFRESH + 10, f"the killed peer stayed on the page for {gone:.1f} s"
    print(f"killed peer gone from the page after {gone:.1f} s")


async def _browse(url: str, peers: list[SwarmProcess], workdir: Path) -> float:
    async with Chromium(workdir) as browser:
        page = await browser.open(url)
        assert await page.evaluate("document.querySelectorAll('tr.peer').length") == 3
        assert "missing blocks: 4:6" in await page.evaluate("document.getElementById('missing').textContent")
        cells = await page.evaluate("[...document.querySelectorAll('.block')].map(b => b.dataset.peers)")
        assert cells == ["1", "1", "1", "1", "0", "0", "1", "1"]
        assert await page.evaluate("document.querySelectorAll('.block.c0').length") == 2  # the missing ones, red
        assert "tokens/s" in await page.evaluate("document.getElementById('throughput').textContent")
        assert "3 peer(s) online" in await page.evaluate("document.getElementById('online').textContent")
        await page.screenshot(workdir / "monitor.png")
        _keep_artifact(workdir / "monitor.png")
        peers[0].kill()  # blocks 0:2, SIGKILL: no goodbye record
        gone = await page.wait_for(
            f"!document.querySelector(\"tr.peer[data-peer-id='{peers[0].peer_id}']\")", timeout=60)
        assert await page.evaluate("document.querySelectorAll('tr.peer').length") == 2
        assert "missing blocks: 0:2, 4:6" in await page.evaluate("document.getElementById('missing').textContent")
        return gone


def _keep_artifact(path: Path) -> None:
    """The screenshot also goes to ``$MONITOR_SCREENSHOT`` when set (how ``docs/monitor.png`` was made)."""
    import os

    if target := os.environ.get("MONITOR_SCREENSHOT"):
        shutil.copy(path, target)
