"""announce / fetch_records / Announcer against real in-process hivemind DHT nodes on 127.0.0.1 (no mocks)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest
from hivemind.utils import get_dht_time

from swarm.announcer import Announcer
from swarm.discovery import announce, fetch_records, start_node, visible_maddrs
from swarm.keys import peers_key
from swarm.records import LinkRow, PeerRecord, PeerState

MODEL = "llama-tiny"
HOST = ("/ip4/127.0.0.1/tcp/0",)


def pid(name: str) -> str:
    return "12D3KooW" + name * 44


def rec(name: str, start: int = 0, end: int = 4, model: str = MODEL, **changes) -> PeerRecord:
    fields = dict(peer_id=pid(name), model=model, start=start, end=end, state=PeerState.ONLINE, throughput=10.0)
    return PeerRecord(**{**fields, **changes})


async def two_nodes():
    first = await start_node(host_maddrs=HOST)
    try:
        second = await start_node(initial_peers=await visible_maddrs(first), host_maddrs=HOST)
    except BaseException:
        await first.shutdown()
        raise
    return first, second


def with_nodes(body):
    """Run ``await body(first, second)`` on two joined nodes, then shut both down whatever happens."""

    async def main():
        first, second = await two_nodes()
        try:
            return await asyncio.wait_for(body(first, second), timeout=30)
        finally:
            await asyncio.gather(first.shutdown(), second.shutdown(), return_exceptions=True)

    return asyncio.run(main())


def test_visible_maddrs_are_complete():
    async def body(first, second):
        return await visible_maddrs(first), str(first.peer_id)

    maddrs, peer_id = with_nodes(body)
    assert maddrs and all(m.startswith("/ip4/127.0.0.1/tcp/") and m.endswith(f"/p2p/{peer_id}") for m in maddrs)


@pytest.mark.parametrize(
    "records",
    [
        [rec("A")],
        [rec("C", 4, 8), rec("A", 0, 4, state=PeerState.JOINING, throughput=0.0), rec("B", 2, 6,
                                                                                        state=PeerState.BACKUP)],
    ],
    ids=["one", "three"],
)
def test_announce_then_fetch_from_other_node(records):
    async def body(first, second):
        for record in records:
            assert await announce(first, record, ttl=30)
        return await fetch_records(second, MODEL), await fetch_records(first, MODEL), await fetch_records(
            second, "other-model")

    from_second, from_first, other = with_nodes(body)
    expected = sorted(records, key=lambda r: r.peer_id)
    assert from_second == expected
    assert from_first == expected
    assert other == []


def test_reannounce_replaces_and_expired_records_vanish():
    async def body(first, second):
        assert await announce(first, rec("A", state=PeerState.JOINING), ttl=30)
        assert await announce(second, rec("A", state=PeerState.ONLINE, throughput=99.0), ttl=31)
        assert await announce(first, rec("B"), ttl=0.5)
        replaced = await fetch_records(second, MODEL)
        await asyncio.sleep(1.0)
        return replaced, await fetch_records(first, MODEL)

    replaced, later = with_nodes(body)
    assert replaced == [rec("A", throughput=99.0), rec("B")]
    assert later == [rec("A", throughput=99.0)]


BAD = [
    # (subkey, value, fragment of the warning)
    (pid("B"), {"bad": 1}, "lacks"),
    (pid("C"), "a string", "must be a dict"),
    (pid("D"), 42, "must be a dict"),
    (pid("E"), [rec("E").to_wire()], "must be a dict"),
    (pid("F"), {**rec("F").to_wire(), "throughput": -1.0}, "bad throughput"),
    (pid("G"), {**rec("G").to_wire(), "state": "paused"}, "bad state"),
    (pid("H"), {**rec("H").to_wire(), "start": 4, "end": 2}, "bad block range"),
    (pid("J"), {**rec("J").to_wire(), "addresses": "/ip4/1.2.3.4/tcp/1"}, "addresses must be a list"),
    (pid("K"), rec("A").to_wire(), "stored under subkey"),  # A's record under K's subkey: an impersonation
    (pid("M"), rec("M", model="other-model").to_wire(), "for model 'other-model'"),
]


def test_malformed_and_misplaced_records_are_dropped(caplog):
    good = [rec("A"), rec("N", 4, 8)]

    async def body(first, second):
        for record in good:
            assert await announce(first, record, ttl=30)
        for subkey, value, _ in BAD:
            assert await second.store(peers_key(MODEL), subkey=subkey, value=value, expiration_time=get_dht_time() + 30)
        with caplog.at_level(logging.WARNING, logger="swarm.discovery"):
            return await fetch_records(first, MODEL)

    found = with_nodes(body)
    assert found == good
    warnings = [r.getMessage() for r in caplog.records if r.name == "swarm.discovery" and r.levelno == logging.WARNING]
    assert len(warnings) == len(BAD)
    for _, _, fragment in BAD:
        assert sum(fragment in w for w in warnings) >= 1, f"no warning says {fragment!r}: {warnings}"
    assert all(peers_key(MODEL) in w for w in warnings)


def test_a_plain_value_under_the_key_is_ignored():
    async def body(first, second):
        assert await first.store(peers_key(MODEL), value="not a dictionary", expiration_time=get_dht_time() + 30)
        return await fetch_records(second, MODEL)

    assert with_nodes(body) == []


@pytest.mark.parametrize("period", [0, -1.0])
def test_announcer_period_must_be_positive(period):
    with pytest.raises(ValueError, match="must be positive"):
        Announcer(None, rec("A"), period=period)  # type: ignore[arg-type]


def test_announcer_keeps_record_alive_then_leaves_offline():
    period = 0.3

    async def body(first, second):
        announcer = Announcer(first, rec("A", state=PeerState.JOINING, throughput=0.0), period=period)
        assert announcer.ttl == pytest.approx(2 * period + 1.0)
        await announcer.start()
        try:
            seen = [await fetch_records(second, MODEL)]
            await asyncio.sleep(announcer.ttl + 2 * period)  # past the first announcement's expiration
            seen.append(await fetch_records(second, MODEL))
            announcer.update(state=PeerState.ONLINE, throughput=42.0)  # announced at once, not after a period
            await asyncio.sleep(period / 2)
            seen.append(await fetch_records(second, MODEL))
        finally:
            await announcer.stop()
        seen.append(await fetch_records(second, MODEL))
        await asyncio.sleep(1.5 * period)  # no heartbeat overwrites the final record
        seen.append(await fetch_records(second, MODEL))
        return seen

    joining, still, online, offline, later = with_nodes(body)
    assert joining == still == [rec("A", state=PeerState.JOINING, throughput=0.0)]
    assert online == [rec("A", state=PeerState.ONLINE, throughput=42.0)]
    assert offline == later == [rec("A", state=PeerState.OFFLINE, throughput=42.0)]


def test_announcer_refreshes_aging_fields_before_each_announcement():
    """A peer's link table ages between announcements: each heartbeat announces fresh rows; a failing refresh
    announces the record as it was."""
    period = 0.3
    rows = iter([(), (LinkRow("12D3KooW" + "B" * 44, 1e8, 0.001, 0.5),), (LinkRow("12D3KooW" + "B" * 44, 1e8, 0.001,
                                                                                1.0),)])

    def refresh(record: PeerRecord) -> PeerRecord:
        try:
            return dataclasses.replace(record, links=next(rows))
        except StopIteration:
            raise RuntimeError("no more rows") from None

    async def body(first, second):
        announcer = Announcer(first, rec("A"), period=period, refresh=refresh)
        await announcer.start()

        async def ages() -> tuple[float, ...]:
            return tuple(row.age for row in (await fetch_records(second, MODEL))[0].links)

        async def until(expected: tuple[float, ...]) -> tuple[float, ...]:
            for _ in range(100):  # heartbeats may be late under load: wait for them, not for a fixed time
                if (found := await ages()) == expected:
                    break
                await asyncio.sleep(period / 4)
            return found

        try:
            seen = [await ages()]
            seen += [await until((0.5,)), await until((1.0,))]
            await asyncio.sleep(3 * period)  # heartbeats whose refresh fails
            seen.append(await ages())
        finally:
            await announcer.stop()
        return seen

    seen = with_nodes(body)
    assert seen == [(), (0.5,), (1.0,), (1.0,)]  # fresh rows each heartbeat; a failed refresh keeps the last
