"""Router policy of issue 15: one ban per failure event (finding 5), capacity refusals and errors that say what
really happened (finding 6)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from swarm.discovery import Snapshot
from swarm.records import PeerRecord, PeerState
from swarm.routing import Hop, MissingBlocksError, NoRouteError, PeersUnavailableError, PrivateSwarmError, Router


def pid(name: str) -> str:
    return "12D3KooW" + name * 44


def rec(name: str, start: int, end: int, throughput: float = 100.0) -> PeerRecord:
    return PeerRecord(peer_id=pid(name), model="m", start=start, end=end, state=PeerState.ONLINE,
                      throughput=throughput)


def fixed(*records: PeerRecord, sealed: int = 0):
    async def fetch() -> list[PeerRecord]:
        return Snapshot(records, sealed)
    return fetch




def router(fetch=None, **kwargs) -> Router:
    return Router(fetch or fixed(), **{"model": "m", "ban_time": 2.0, "max_ban_time": 60.0, **kwargs})


# ---- finding 5: bans escalate once per failure event, not once per session ------------------------------------
@pytest.mark.parametrize("sessions", [2, 8])
def test_finding_05_one_kill_seen_by_many_sessions_is_one_ban(clock, sessions):
    """Every session on a killed peer reports it; that is one failure: one ban of ``ban_time``, not 2, 4, ... 60 s."""
    r = router()
    for _ in range(sessions):
        r.on_failure(pid("A"), ConnectionError("stream broke"), started=clock.now - 0.5)
        clock.now += 0.01
    assert r.ban(pid("A")).duration == 2.0
    clock.now = r.ban(pid("A")).until + 0.01  # the restarted peer is tried again 2 s later
    assert r.banned() == set()


def test_finding_05_a_new_failure_after_the_ban_doubles_it(clock):
    r = router()
    r.on_failure(pid("A"), ConnectionError("first"))
    clock.now += 2.01
    r.on_failure(pid("A"), ConnectionError("second"))  # tried after the ban ended, failed again: a new event
    assert r.ban(pid("A")).duration == 4.0
    r.on_failure(pid("A"), ConnectionError("same event"))
    assert r.ban(pid("A")).duration == 4.0 and r.ban(pid("A")).error == "second"


def test_finding_05_a_request_sent_before_the_ban_belongs_to_its_event(clock):
    """A slow request (say a 30 s timeout) that was sent before the ban and fails after it ended is old news."""
    r = router()
    sent = clock.now
    clock.now += 1.0
    r.on_failure(pid("A"), ConnectionError("stream broke"), started=sent)
    clock.now += 10.0  # the 2 s ban is over
    r.on_failure(pid("A"), TimeoutError("late reply"), started=sent)
    assert r.banned() == set() and r.ban(pid("A")).duration == 2.0
    r.on_failure(pid("A"), TimeoutError("new"), started=clock.now)
    assert r.ban(pid("A")).duration == 4.0


def test_finding_05_success_lifts_the_ban_and_a_later_failure_starts_over(clock):
    r = router()
    r.on_failure(pid("A"))
    clock.now += 2.01
    r.on_failure(pid("A"))
    r.on_success(pid("A"))
    assert r.ban(pid("A")) is None
    r.on_failure(pid("A"))
    assert r.ban(pid("A")).duration == 2.0


# ---- finding 6: capacity refusals are not failures; errors say what happened ----------------------------------
def test_finding_06_a_busy_peer_is_routed_around_but_not_banned(clock):
    r = router(fixed(rec("A", 0, 8, 1000.0), rec("B", 0, 8, 1.0)))
    r.on_busy(pid("A"), ValueError("cache full: this session needs 100 token slots"))
    assert r.banned() == set() and r.ban(pid("A")) is None
    assert asyncio.run(r.make_chain(0, 8)) == [Hop(pid("B"), 0, 8)]
    clock.now += 1.01  # busy for a short while only
    assert asyncio.run(r.make_chain(0, 8)) == [Hop(pid("A"), 0, 8)]
    r.on_busy(pid("A"))
    r.on_failure(pid("A"))  # being busy never made a failure escalate
    assert r.ban(pid("A")).duration == 2.0


def test_finding_06_every_peer_banned_says_banned_not_missing(clock):
    r = router(fixed(rec("A", 0, 4), rec("B", 4, 8), rec("C", 4, 8)), max_wait=1.0)
    for _ in range(5):  # escalated bans: 2, 4, 8, 16, 32 s
        clock.now += 60.0
        r.on_failure(pid("B"), ConnectionError("peer ...BBBBBB closed the stream"))
    r.on_failure(pid("C"), TimeoutError("peer ...CCCCCC did not answer within 10.0 s"))
    r.on_failure(pid("C"), TimeoutError("not escalated"))
    with pytest.raises(PeersUnavailableError) as info:
        asyncio.run(r.make_chain(0, 8))  # B is banned for 32 s, C for 2 s: both beyond the 1 s it may wait
    error = info.value
    message = str(error)
    assert isinstance(error, NoRouteError) and not isinstance(error, MissingBlocksError)
    assert (error.start, error.end) == (4, 8) and sorted(p.peer_id for p in error.peers) == [pid("B"), pid("C")]
    assert "all 2 peer(s) serving blocks 4:8 of m are banned" in message
    assert "banned until" in message and "closed the stream" in message and "did not answer" in message
    assert "No online peer" not in message and "--block_indices 4:8" in message


def test_finding_06_a_span_whose_only_peer_is_busy_says_busy():
    r = router(fixed(rec("A", 0, 8)), max_wait=0.0)
    r.on_busy(pid("A"), ValueError("peer ...AAAAAA refused the session: cache full: 0 of 200 are free"), 30.0)
    with pytest.raises(PeersUnavailableError, match=r"all 1 peer\(s\) serving blocks 0:8 of m are busy: .*cache full"):
        asyncio.run(r.make_chain(0, 8))


def test_finding_06_a_busy_peer_is_waited_for_within_max_wait():
    r = router(fixed(rec("A", 0, 8)), max_wait=5.0)
    r.on_busy(pid("A"), ValueError("cache full"), 0.2)
    assert asyncio.run(r.make_chain(0, 8)) == [Hop(pid("A"), 0, 8)]


def test_finding_06_a_busy_mark_expiring_between_two_looks_still_names_the_whole_span(clock, monkeypatch):
    """CI caught it: both replicas of 0:8 busy, the chain is sought (none), then one mark expires before the
    blockers are listed. It must seek the chain again, not blame "all 1 peer(s) serving blocks 0:1"."""
    r = router(fixed(rec("A", 0, 8), rec("B", 0, 8)), max_wait=5.0)
    r.on_busy(pid("A"), ValueError("cache full"), 1.0)
    r.on_busy(pid("B"), ValueError("cache full"), 30.0)
    seek, looks = r._chain, []

    def seek_then_expire(start: int, end: int):
        chain = seek(start, end)
        looks.append(chain)
        if len(looks) == 3:  # the first look of the waiting loop (two before it: cached and refreshed snapshot)
            clock.now += 1.5  # A's mark runs out right after a look that found no chain
        return chain

    monkeypatch.setattr(r, "_chain", seek_then_expire)
    assert asyncio.run(r.make_chain(0, 8)) == [Hop(pid("A"), 0, 8)]
    assert looks[:3] == [None, None, None]


def test_finding_06_sealed_records_say_the_swarm_is_private(clock):
    r = router(fixed(sealed=3), missing_grace=0.0)
    with pytest.raises(PrivateSwarmError) as info:
        asyncio.run(r.make_chain(0, 8))
    message = str(info.value)
    assert "this swarm is private: 3 sealed record(s)" in message and "--private CREDENTIALS --identity_path" in message
    assert "No online peer" not in message and not isinstance(info.value, MissingBlocksError)


def test_finding_06_nobody_serving_a_span_is_still_missing_blocks(clock):
    r = router(fixed(rec("A", 0, 4)), missing_grace=0.0)
    r.on_failure(pid("A"))
    with pytest.raises(MissingBlocksError, match=r"No online peer serves block\(s\) 4, 5, 6, 7 of m"):
        asyncio.run(r.make_chain(0, 8))


def test_finding_06_a_session_refused_by_every_peer_names_them_all(clock):
    r = router(fixed(rec("A", 0, 8), rec("B", 0, 8), rec("C", 0, 4)))
    asyncio.run(r.refresh())
    r.on_busy(pid("A"), ValueError("busy: cache full: 0 of 40 free"))
    r.on_failure(pid("C"), ConnectionError("closed"))
    error = r.unavailable_error(0, 8, {pid("A"): "busy: cache full: 0 of 40 free", pid("B"): "busy: cache full"})
    assert [(p.peer_id, p.state) for p in error.peers] == [(pid("A"), "busy"), (pid("B"), "busy"), (pid("C"), "banned")]
    assert "all 3 peer(s) serving blocks 0:8 of m are banned or busy" in str(error)


def test_finding_06_training_names_the_banned_peers_a_pipeline_needs(clock):
    """Not just "the online peers' spans do not tile": which banned peers would make the pipeline, and until when."""
    from peers.trainer.pipeline import why_no_pipeline
    from swarm.stages import NoPipelineError

    r = router(max_wait=10.0)
    for _ in range(4):  # escalated to 16 s: beyond what the trainer may wait
        clock.now += 100.0
        r.on_failure(pid("B"), ConnectionError("peer ...BBBBBB closed the stream"))
    trainer = SimpleNamespace(client=SimpleNamespace(router=r, model_config=SimpleNamespace(num_layers=8),
                                                     model_name="m"))
    snapshot = Snapshot([rec("A", 0, 4), rec("B", 4, 8)])
    banned_b = r"do not tile blocks 0:8; .*\.\.\.BBBBBB banned until .*closed the stream"
    with pytest.raises(NoPipelineError, match=banned_b):
        why_no_pipeline(trainer, NoPipelineError("the online peers' spans (0:4) do not tile blocks 0:8"),
                        snapshot, {pid("B")}, 5.0)
    r.on_success(pid("B"))
    r.on_failure(pid("B"))  # 2 s: the trainer waits for it instead
    why_no_pipeline(trainer, NoPipelineError("no tiling"), snapshot, {pid("B")}, 5.0)
    with pytest.raises(PrivateSwarmError):
        why_no_pipeline(trainer, NoPipelineError("no tiling"), Snapshot([], 2), set(), 5.0)
