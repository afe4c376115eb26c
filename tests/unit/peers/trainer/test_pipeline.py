"""``peers.trainer.pipeline``: a banned peer without which there is no pipeline is tried again while the trainer
waits, and taken back once it answers (a lone stage's peer restarted under its identity while its ban runs)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

import peers.trainer.pipeline as pipeline
from swarm.discovery import Snapshot
from swarm.records import PeerRecord, PeerState
from swarm.routing import Router
from swarm.stages import NoPipelineError


def pid(name: str) -> str:
    return "12D3KooW" + name * 44


def rec(name: str, start: int, end: int) -> PeerRecord:
    return PeerRecord(peer_id=pid(name), model="m", start=start, end=end, state=PeerState.ONLINE, throughput=100.0)


def _trainer(answers: bool, tried: list[str]) -> SimpleNamespace:
    async def fetch():
        return Snapshot([rec("A", 0, 4), rec("B", 4, 8)], 0)

    async def peer_stream(peer_id: str):
        tried.append(peer_id)
        if not answers:
            raise ConnectionError("failed to dial: connection refused")
        return object()

    router = Router(fetch, model="m", ban_time=30.0, max_wait=10.0)
    router.on_failure(pid("B"), ConnectionError("peer ...BBBBBB closed the stream"))  # banned for 30 s
    client = SimpleNamespace(router=router, model_config=SimpleNamespace(num_layers=8), model_name="m", _fetch=fetch,
                             peer_stream=peer_stream)
    return SimpleNamespace(client=client, run_id="run")


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(pipeline, "POLL", 0.01)
    monkeypatch.setattr(pipeline, "PROBE_EVERY", 0.0)


def test_finding_chaos_a_banned_peer_that_answers_again_is_taken_back():
    tried: list[str] = []
    trainer = _trainer(answers=True, tried=tried)
    groups = asyncio.run(asyncio.wait_for(pipeline.stage_groups(trainer, grace=60.0), 10))
    assert [[r.peer_id for r in group] for group in groups] == [[pid("A")], [pid("B")]]
    assert tried == [pid("B")] and pid("B") not in trainer.client.router.banned()  # at once, not after 30 s


def test_a_banned_peer_that_does_not_answer_stays_banned_and_is_named():
    tried: list[str] = []
    trainer = _trainer(answers=False, tried=tried)
    with pytest.raises(NoPipelineError, match=r"do not tile blocks 0:8; .*\.\.\.BBBBBB banned until"):
        asyncio.run(asyncio.wait_for(pipeline.stage_groups(trainer, grace=0.2), 10))
    assert tried and set(tried) == {pid("B")} and pid("B") in trainer.client.router.banned()
