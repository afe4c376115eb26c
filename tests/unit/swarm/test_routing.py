"""make_chain (pure path search) and Router (snapshot refresh, bans, RTT estimates)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random

import pytest

import swarm.routing as routing
from swarm.records import DEFAULT_SECONDS_PER_BLOCK, PeerRecord, PeerState
from swarm.routing import DEFAULT_RTT, Hop, MissingBlocksError, Router, make_chain

ON, JOIN, OFF, BACK = PeerState.ONLINE, PeerState.JOINING, PeerState.OFFLINE, PeerState.BACKUP


def pid(name: str) -> str:
    return "12D3KooW" + name * 44


def rec(name: str, start: int, end: int, throughput: float = 100.0, state: PeerState = ON) -> PeerRecord:
    return PeerRecord(peer_id=pid(name), model="m", start=start, end=end, state=state, throughput=throughput)


def hops(*spec: tuple[str, int, int]) -> list[Hop]:
    return [Hop(pid(name), s, e) for name, s, e in spec]


@pytest.mark.parametrize(
    "records, start, end, kwargs, expected",
    [
        # single peer
        ([rec("A", 0, 8)], 0, 8, {}, hops(("A", 0, 8))),
        # two peers, each with half
        ([rec("A", 0, 4), rec("B", 4, 8)], 0, 8, {}, hops(("A", 0, 4), ("B", 4, 8))),
        ([rec("B", 4, 8), rec("A", 0, 4)], 0, 8, {}, hops(("A", 0, 4), ("B", 4, 8))),
        # equal speed: fewer hops win
        ([rec("B", 0, 4), rec("C", 4, 8), rec("A", 0, 8)], 0, 8, {}, hops(("A", 0, 8))),
        ([rec("A", 0, 2), rec("B", 2, 4), rec("C", 4, 6), rec("D", 6, 8), rec("E", 0, 8)], 0, 8, {},
         hops(("E", 0, 8))),
        # the faster peer wins
        ([rec("A", 0, 8, 1.0), rec("B", 0, 8, 1000.0)], 0, 8, {}, hops(("B", 0, 8))),
        ([rec("A", 0, 8, 1000.0), rec("B", 0, 8, 1.0)], 0, 8, {}, hops(("A", 0, 8))),
        # a much faster two-hop chain beats a slow single peer
        ([rec("A", 0, 8, 1.0), rec("B", 0, 4, 1000.0), rec("C", 4, 8, 1000.0)], 0, 8, {},
         hops(("B", 0, 4), ("C", 4, 8))),
        # a slow peer is used only for the blocks nobody else has
        ([rec("A", 0, 8, 1.0), rec("B", 0, 6, 1000.0)], 0, 8, {}, hops(("B", 0, 6), ("A", 6, 8))),
        # RTT decides between equally fast peers
        ([rec("A", 0, 8), rec("B", 0, 8)], 0, 8, {"rtt": {pid("A"): 1.0, pid("B"): 0.01}}, hops(("B", 0, 8))),
        ([rec("A", 0, 8), rec("B", 0, 8)], 0, 8, {"rtt": {pid("A"): 0.01, pid("B"): 1.0}}, hops(("A", 0, 8))),
        ([rec("A", 0, 8), rec("B", 0, 8)], 0, 8, {"rtt": {pid("A"): 0.5}}, hops(("B", 0, 8))),  # B: DEFAULT_RTT
        # RTT can outweigh compute: far fast peer vs. near slow one
        ([rec("A", 0, 8, 1000.0), rec("B", 0, 8, 100.0)], 0, 8, {"rtt": {pid("A"): 2.0, pid("B"): 0.001}},
         hops(("B", 0, 8))),
        # banned peers are skipped
        ([rec("A", 0, 8, 1000.0), rec("B", 0, 8, 1.0)], 0, 8, {"banned": [pid("A")]}, hops(("B", 0, 8))),
        ([rec("A", 0, 8), rec("B", 0, 4), rec("C", 4, 8)], 0, 8, {"banned": {pid("A")}},
         hops(("B", 0, 4), ("C", 4, 8))),
        # sub-spans
        ([rec("A", 0, 8)], 2, 5, {}, hops(("A", 2, 5))),
        ([rec("A", 0, 8)], 7, 8, {}, hops(("A", 7, 8))),
        ([rec("A", 0, 4), rec("B", 4, 8)], 3, 6, {}, hops(("A", 3, 4), ("B", 4, 6))),
        ([rec("A", 0, 4), rec("B", 4, 8)], 4, 8, {}, hops(("B", 4, 8))),
        ([rec("A", 0, 4), rec("B", 4, 8)], 0, 2, {}, hops(("A", 0, 2))),
        # only online peers route
        ([rec("A", 0, 8, 1000.0, JOIN), rec("B", 0, 8, 1.0)], 0, 8, {}, hops(("B", 0, 8))),
        ([rec("A", 0, 8, 1000.0, OFF), rec("B", 0, 8, 1.0)], 0, 8, {}, hops(("B", 0, 8))),
        ([rec("A", 0, 8, 1000.0, BACK), rec("B", 0, 8, 1.0)], 0, 8, {}, hops(("B", 0, 8))),
    ],
)
def test_make_chain(records, start, end, kwargs, expected):
    assert make_chain(records, start, end, **kwargs) == expected


@pytest.mark.parametrize("seed", range(8))
def test_make_chain_is_a_valid_chain_on_random_swarms(seed):
    """Whatever the swarm, the chain covers [start, end) in order, each hop within its online peer's span."""
    rng = random.Random(seed)
    total = 12
    records = [rec("A", 0, total, 0.5)]  # slow but online everywhere: every span is routable
    for name in "BCDEFGHJK":
        s = rng.randrange(total)
        state = rng.choice([ON, ON, JOIN, OFF])
        records.append(rec(name, s, rng.randrange(s + 1, total + 1), rng.uniform(1, 1000), state))
    by_peer = {r.peer_id: r for r in records}
    start = rng.randrange(total)
    end = rng.randrange(start + 1, total + 1)
    rtt = {pid("B"): 0.2}
    chain = make_chain(records, start, end, rtt=rtt)
    assert chain[0].start == start and chain[-1].end == end
    for hop, nxt in itertools.pairwise(chain):
        assert hop.end == nxt.start
    for hop in chain:
        peer = by_peer[hop.peer_id]
        assert peer.state == ON
        assert peer.start <= hop.start < hop.end <= peer.end

    def edge(peer_id: str, s: int, e: int) -> float:
        r = by_peer[peer_id]
        return rtt.get(peer_id, DEFAULT_RTT) + routing.HOP_PENALTY + (e - s) / r.throughput

    # brute force over block boundaries: the chain's cost is the optimum
    optimum = {start: 0.0}
    for s in range(start, end):
        for r in records:
            if r.state == ON and r.start <= s < r.end:
                for e in range(s + 1, min(r.end, end) + 1):
                    optimum[e] = min(optimum.get(e, float("inf")), optimum[s] + edge(r.peer_id, s, e))
    assert sum(edge(h.peer_id, h.start, h.end) for h in chain) == pytest.approx(optimum[end], rel=1e-12)


@pytest.mark.parametrize(
    "records, start, end, kwargs, missing",
    [
        ([], 0, 4, {}, [0, 1, 2, 3]),
        ([rec("A", 0, 2), rec("B", 5, 8)], 0, 8, {}, [2, 3, 4]),
        ([rec("A", 0, 2), rec("B", 3, 8)], 0, 8, {}, [2]),
        ([rec("A", 0, 2)], 1, 4, {}, [2, 3]),
        ([rec("A", 1, 8)], 0, 8, {}, [0]),
        ([rec("A", 0, 8)], 0, 8, {"banned": [pid("A")]}, list(range(8))),
        ([rec("A", 0, 4), rec("B", 4, 8)], 0, 8, {"banned": [pid("B")]}, [4, 5, 6, 7]),
        ([rec("A", 0, 8, 5.0, JOIN)], 0, 8, {}, list(range(8))),
        ([rec("A", 0, 4), rec("B", 4, 8, 5.0, OFF), rec("C", 6, 8, 5.0, BACK)], 0, 8, {}, [4, 5, 6, 7]),
    ],
)
def test_missing_blocks_error(records, start, end, kwargs, missing):
    with pytest.raises(MissingBlocksError) as info:
        make_chain(records, start, end, model="llama-tiny", **kwargs)
    err = info.value
    assert err.blocks == missing
    message = str(err)
    assert "llama-tiny" in message
    assert f"block(s) {', '.join(map(str, missing))} of" in message
    assert f"--block_indices {missing[0]}:{missing[-1] + 1}" in message  # what to start
    assert "swarm status" in message
    assert isinstance(err, RuntimeError)


def test_missing_blocks_error_shortens_long_lists():
    err = MissingBlocksError("big", list(range(40)))
    assert "0, 1, 2" in str(err) and "15 ..." in str(err) and "16," not in str(err)
    assert "--block_indices 0:40" in str(err)




class FakeFetch:
    """An async fetch function that returns the next snapshot on each call (the last one forever)."""

    def __init__(self, *snapshots: list[PeerRecord]) -> None:
        self.snapshots, self.calls = list(snapshots), 0

    async def __call__(self) -> list[PeerRecord]:
        await asyncio.sleep(0)
        snapshot = self.snapshots[min(self.calls, len(self.snapshots) - 1)]
        self.calls += 1
        return list(snapshot)


def router(fetch=None, **kwargs) -> Router:
    kwargs = {"model": "m", "ban_time": 1.0, "max_ban_time": 5.0, **kwargs}
    return Router(fetch or FakeFetch([]), **kwargs)


@pytest.mark.parametrize(
    "failures, ban_time, max_ban_time, duration",
    [
        (1, 1.0, 5.0, 1.0),
        (2, 1.0, 5.0, 2.0),
        (3, 1.0, 5.0, 4.0),
        (4, 1.0, 5.0, 5.0),  # 8 capped at the max
        (6, 1.0, 5.0, 5.0),
        (1, 0.5, 60.0, 0.5),
        (5, 0.5, 60.0, 8.0),
        (3, 2.0, 3.0, 3.0),
    ],
)
def test_ban_doubles_up_to_max(clock, failures, ban_time, max_ban_time, duration):
    """Each new failure after the previous ban ended doubles the ban."""
    r = router(ban_time=ban_time, max_ban_time=max_ban_time)
    for _ in range(failures):
        if r.ban(pid("A")) is not None:
            clock.now = r.ban(pid("A")).until + 0.01  # the last ban is over: the peer is tried, and fails again
        r.on_failure(pid("A"), RuntimeError("boom"))
    t0 = clock.now
    assert r.banned() == {pid("A")} and r.ban(pid("A")).duration == duration
    clock.now = t0 + duration - 0.01
    assert r.banned() == {pid("A")}
    clock.now = t0 + duration + 0.01
    assert r.banned() == set()


def test_ban_counts_from_the_last_failure(clock):
    r = router()
    r.on_failure(pid("A"))  # 1 s
    clock.now += 1.5  # expired
    assert r.banned() == set()
    r.on_failure(pid("A"))  # still consecutive: 2 s from now
    clock.now += 1.9
    assert r.banned() == {pid("A")}
    clock.now += 0.2
    assert r.banned() == set()


def test_bans_are_per_peer(clock):
    r = router()
    r.on_failure(pid("A"))
    clock.now += 1.01
    r.on_failure(pid("A"))  # a new failure after the first ban: 2 s
    r.on_failure(pid("B"))
    clock.now += 1.5
    assert r.banned() == {pid("A")}


@pytest.mark.parametrize("failures", [1, 3, 10])
def test_success_lifts_ban_and_resets_backoff(clock, failures):
    r = router()
    for _ in range(failures):
        r.on_failure(pid("A"))
    r.on_success(pid("A"))
    assert r.banned() == set()
    r.on_failure(pid("A"))  # starts over at ban_time
    clock.now += 1.01
    assert r.banned() == set()


@pytest.mark.parametrize(
    "samples, expected",
    [
        ([(0.1, 0.0)], 0.1),
        ([(0.1, 0.0), (0.2, 0.0)], 0.15),
        ([(0.3, 0.2)], 0.1),  # the peer's reported compute is not network time
        ([(0.3, 0.2), (0.5, 0.4)], 0.1),
        ([(0.01, 5.0)], 0.0),  # compute is never trusted beyond the wall time
        ([(0.05, float("nan")), (0.07, 0.0)], 0.07),  # an invalid report makes no sample
        ([(1.0, 0.0)] * 5, 1.0),
    ],
)
def test_router_rtt_is_network_time(samples, expected):
    r = router()
    for wall, compute in samples:
        r.observe(pid("A"), wall, compute, 200)
    assert r.rtt[pid("A")] == pytest.approx(expected)
    assert pid("B") not in r.rtt


def test_success_without_timing_does_not_create_an_estimate():
    r = router()
    r.on_success(pid("A"))
    assert r.rtt == {}


def test_router_counts_compute_once(clock):
    """A peer whose compute dominates its hop (slow blocks, near) against one whose network does (fast blocks,
    far). Network time: A's hop costs 0.01 + 8 * 0.05 = 0.41 s, B's 0.5 + 8 * 0.001 = 0.508 s: A is faster. Taking
    the whole hop time for the round trip (the old router) counted A's compute twice (0.81 s) and chose B."""
    fetch = FakeFetch([rec("A", 0, 8, throughput=20.0), rec("B", 0, 8, throughput=1000.0)])
    r = router(fetch)
    for _ in range(3):
        r.observe(pid("A"), 0.41, 0.40, 200)  # wall time, the peer's reported compute, bytes
        r.observe(pid("B"), 0.508, 0.008, 200)

    assert asyncio.run(r.make_chain(0, 8)) == hops(("A", 0, 8))
    assert r.rtt[pid("A")] == pytest.approx(0.01) and r.rtt[pid("B")] == pytest.approx(0.5)


@pytest.mark.parametrize(
    "record, seconds",
    [
        (rec("A", 0, 8, throughput=50.0), 0.02),  # an older peer: from its throughput
        (dataclasses.replace(rec("A", 0, 8, throughput=50.0), forward_seconds=0.004), 0.004),  # measured wins
        (rec("A", 0, 8, throughput=0.0), DEFAULT_SECONDS_PER_BLOCK),  # nothing known: the conservative default
    ],
)
def test_make_chain_takes_compute_from_the_record(record, seconds):
    """The chain's cost per block is the record's forward compute: a far but fast peer loses to a near slow one
    exactly when its extra round trip outweighs the compute it saves."""
    other = rec("B", 0, 8, throughput=1.0 / (seconds + 0.001))  # 1 ms per block slower than A
    assert make_chain([record, other], 0, 8, rtt={pid("A"): 0.0079, pid("B"): 0.0}) == hops(("A", 0, 8))
    assert make_chain([record, other], 0, 8, rtt={pid("A"): 0.0081, pid("B"): 0.0}) == hops(("B", 0, 8))


def test_router_make_chain_refreshes_once_when_snapshot_lacks_blocks(clock):
    fetch = FakeFetch([rec("A", 0, 4)], [rec("A", 0, 4), rec("B", 4, 8)])
    r = router(fetch, refresh_period=100.0)

    async def main():
        return await r.make_chain(0, 8)

    assert asyncio.run(main()) == hops(("A", 0, 4), ("B", 4, 8))
    assert fetch.calls == 2


def test_router_make_chain_raises_after_one_refresh(clock):
    fetch = FakeFetch([rec("A", 0, 4)])
    r = router(fetch, refresh_period=100.0, model="llama-tiny", missing_grace=0.0)

    async def main():
        return await r.make_chain(0, 8)

    with pytest.raises(MissingBlocksError) as info:
        asyncio.run(main())
    assert info.value.blocks == [4, 5, 6, 7]
    assert "llama-tiny" in str(info.value)
    assert fetch.calls == 2


def test_router_waits_a_grace_period_for_a_late_heartbeat(clock, monkeypatch):
    """A peer whose record lapsed for a moment (late heartbeat under load) does not fail the request."""
    monkeypatch.setattr(routing, "GRACE_POLL", 0.001)
    fetch = FakeFetch([rec("A", 0, 4)], [rec("A", 0, 4)], [rec("A", 0, 4), rec("B", 4, 8)])
    r = router(fetch, refresh_period=100.0, missing_grace=0.005)

    async def main():
        return await r.make_chain(0, 8)

    assert asyncio.run(main()) == hops(("A", 0, 4), ("B", 4, 8))
    assert fetch.calls == 3


def test_router_uses_cached_snapshot_within_refresh_period(clock):
    fetch = FakeFetch([rec("A", 0, 8)], [rec("B", 0, 8)])
    r = router(fetch, refresh_period=5.0)

    async def main():
        first = await r.make_chain(0, 8)
        clock.now += 4.0
        second = await r.make_chain(0, 8)  # still fresh: no fetch
        clock.now += 1.5
        third = await r.make_chain(0, 8)  # stale: fetched again
        return first, second, third

    first, second, third = asyncio.run(main())
    assert first == second == hops(("A", 0, 8))
    assert third == hops(("B", 0, 8))
    assert fetch.calls == 2


def test_router_make_chain_avoids_banned_and_prefers_measured_rtt(clock):
    fetch = FakeFetch([rec("A", 0, 8), rec("B", 0, 8), rec("C", 0, 8)])
    r = router(fetch)

    async def main():
        r.observe(pid("A"), 0.6, 0.1, 200)  # 0.5 s of network time
        r.observe(pid("B"), 0.011, 0.01, 200)
        r.on_failure(pid("B"))
        banned_b = await r.make_chain(0, 8)
        clock.now += 1.01  # B's ban ends
        return banned_b, await r.make_chain(0, 8)

    banned_b, after = asyncio.run(main())
    assert banned_b == hops(("C", 0, 8))  # A is slow (0.5 s), B banned, C has the default RTT
    assert after == hops(("B", 0, 8))


def test_router_refresh_force(clock):
    fetch = FakeFetch([rec("A", 0, 8)], [rec("B", 0, 8)])
    r = router(fetch, refresh_period=100.0)

    async def main():
        await r.refresh()
        await r.refresh()
        return await r.refresh(force=True)

    assert asyncio.run(main()) == [rec("B", 0, 8)]
    assert fetch.calls == 2


def test_router_waits_for_a_ban_to_end_when_only_banned_peers_serve_a_span():
    import asyncio

    from swarm.records import PeerRecord, PeerState
    from swarm.routing import Router

    peer = "12D3KooW" + "A" * 44
    record = PeerRecord(peer_id=peer, model="m", start=0, end=4, state=PeerState.ONLINE, throughput=10.0)

    async def fetch():
        return [record]

    router = Router(fetch, model="m", ban_time=0.3)
    router.on_failure(peer, RuntimeError("transient"))
    chain = asyncio.run(router.make_chain(0, 4))  # waits ~0.3 s instead of failing
    assert [(h.peer_id, h.start, h.end) for h in chain] == [(peer, 0, 4)]
