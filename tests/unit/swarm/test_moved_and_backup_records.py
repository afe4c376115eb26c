"""Issue 13 item 3: a peer that moved is routed around without a ban (its stale record ignored), and BACKUP records
count for nothing: routing, block coverage, missing blocks and the trainer's stage choice skip them."""

from __future__ import annotations

import asyncio
import dataclasses

from swarm.block_selection import block_throughputs, choose_blocks, missing_blocks
from swarm.discovery import Snapshot
from swarm.records import PeerRecord, PeerState
from swarm.routing import Router, make_chain
from swarm.stages import choose_stage_groups, choose_stages


def pid(name: str) -> str:
    return "12D3KooW" + name * 44


def rec(name: str, start: int, end: int, state: PeerState = PeerState.ONLINE) -> PeerRecord:
    return PeerRecord(peer_id=pid(name), model="m", start=start, end=end, state=state, throughput=100.0)


def test_a_moved_peer_is_not_banned_and_its_stale_record_is_ignored(clock):
    snapshots = [Snapshot([rec("A", 0, 2), rec("B", 0, 2), rec("C", 2, 4)], 0)]

    async def fetch() -> list[PeerRecord]:
        return snapshots[-1]

    router = Router(fetch, model="m")

    async def scenario():
        await router.refresh(force=True)
        router.on_moved(pid("A"), 0, 2, RuntimeError("moved: this peer now serves 2:4"))
        assert router.banned() == set() and router.ban(pid("A")) is None
        chain = await router.make_chain(0, 4)  # the DHT still holds A's old record: it is ignored
        assert [h.peer_id for h in chain][0] == pid("B")
        snapshots.append(Snapshot([rec("A", 2, 4), rec("B", 0, 2), rec("C", 2, 4)], 3))
        records = await router.refresh(force=True)
        assert rec("A", 2, 4) in records and getattr(records, "sealed", None) == 3  # its new span is used
        clock.now += 120  # long after: a record naming the old span again is believed again
        snapshots.append(Snapshot([rec("A", 0, 2), rec("C", 2, 4)], 0))
        assert rec("A", 0, 2) in await router.refresh(force=True)

    asyncio.run(scenario())


def test_backup_records_serve_nothing():
    backup = rec("K", 0, 4, PeerState.BACKUP)
    online = [rec("A", 0, 2), rec("B", 2, 4)]
    assert [h.peer_id for h in make_chain([backup, *online], 0, 4)] == [pid("A"), pid("B")]
    assert missing_blocks([backup, rec("A", 0, 2)], 4) == [2, 3]
    assert block_throughputs([backup], 4) == block_throughputs([], 4)
    assert choose_blocks([backup, rec("A", 0, 2)], 4, 2) == (2, 4)
    assert choose_stages([backup, *online], 4) == online
    groups = choose_stage_groups([backup, *online, dataclasses.replace(backup, peer_id=pid("L"), end=2)], 4)
    assert [[r.peer_id for r in g] for g in groups] == [[pid("A")], [pid("B")]]
