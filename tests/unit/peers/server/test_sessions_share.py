"""SessionRegistry in-process: each client's share of the cache, borrowing beyond it, and the FIFO wait for space."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from peers.server.kv_sessions import SessionRegistry
from peers.wire.errors import CAPACITY_REFUSAL, CapacityError, RequestError
from peers.wire.messages import InferenceOpen

SERVED = (0, 8)
LONG = 30.0  # a wait that the test always ends first (by a close or a cancel)
_ids = itertools.count()


def registry(cache_tokens: int = 1000, share: float = 0.5, timeout: float = 60.0) -> SessionRegistry:
    return SessionRegistry(cache_tokens=cache_tokens, timeout=timeout, max_length_limit=4096, client_share=share,
                           cache_wait=LONG)


def request(tokens: int) -> InferenceOpen:
    return InferenceOpen(session_id=f"s{next(_ids)}", start=0, end=8, max_length=tokens, batch_size=1)


async def open_(reg: SessionRegistry, owner: str, tokens: int, wait: float = 0.0):
    return await reg.open(request(tokens), owner, SERVED, wait=wait)


async def waiting(reg: SessionRegistry, owner: str, tokens: int) -> asyncio.Task:
    """An open that waits (up to LONG s) for space; returns once it is queued."""
    before = reg.opens_waiting
    task = asyncio.ensure_future(open_(reg, owner, tokens, wait=LONG))
    while reg.opens_waiting == before and not task.done():
        await asyncio.sleep(0)
    return task


def test_finding_11_borrowing_stops_while_another_client_waits():
    """A alone may fill the cache, but not take freed space while B waits for space within its share."""

    async def main():
        reg = registry()
        a = [await open_(reg, "A", 100) for _ in range(9)]  # 900 of 1000: beyond A's share of 500
        b = await waiting(reg, "B", 200)
        with pytest.raises(CapacityError) as refused:
            await open_(reg, "A", 100)  # it fits, but A would borrow while B waits
        assert str(refused.value).startswith(CAPACITY_REFUSAL)
        assert "this client already holds 900 of 1000 cache tokens (its share is 500)" in str(refused.value)
        reg.close(a[0].session_id)  # 200 free: B's
        session = await b
        assert session.owner == "B" and reg.held_by("B") == 200 and reg.tokens_free == 0

    asyncio.run(main())


def test_finding_11_waiting_open_gets_the_space_a_close_frees():
    async def main():
        reg = registry()
        a = [await open_(reg, "A", 250) for _ in range(4)]
        b = await waiting(reg, "B", 250)
        assert not b.done() and reg.opens_waiting == 1
        reg.close(a[2].session_id)
        assert (await b).owner == "B" and reg.opens_waiting == 0

    asyncio.run(main())


def test_finding_11_reaping_frees_space_for_a_waiting_open():
    """An expired session is reaped by the waiting open itself, not only by the server's reaper."""

    async def main():
        reg = registry(timeout=0.2)
        await open_(reg, "A", 1000)
        assert (await open_(reg, "B", 300, wait=LONG)).owner == "B"  # A's session expires while B waits
        assert reg.held_by("A") == 0

    asyncio.run(main())


def test_finding_11_refusals_say_whose_limit_was_hit():
    async def main():
        reg = registry()
        await open_(reg, "A", 600)
        await open_(reg, "B", 300)
        with pytest.raises(CapacityError) as full:
            await open_(reg, "B", 150)  # within B's share: the cache is full
        assert str(full.value).startswith(f"{CAPACITY_REFUSAL} cache full: this session needs 150 token slots "
                                          "but 100 of 1000 are free")
        assert "free in ~" in str(full.value)
        with pytest.raises(CapacityError) as share:
            await open_(reg, "A", 100)  # fits, but A is beyond its share and B was just turned away
        assert str(share.value).startswith(f"{CAPACITY_REFUSAL} this client already holds 600 of 1000 cache "
                                           "tokens (its share is 500)")
        with pytest.raises(RequestError) as never:
            await open_(reg, "C", 1001)  # never fits: not a capacity refusal to retry
        assert not isinstance(never.value, CapacityError) and "whole cache has 1000" in str(never.value)

    asyncio.run(main())


def test_finding_11_a_refused_client_is_owed_its_share():
    """After B was turned away, space that frees goes to B's retry, not to A beyond A's share."""

    async def main():
        reg = registry()
        a = [await open_(reg, "A", 100) for _ in range(10)]  # A alone holds everything
        with pytest.raises(CapacityError, match="cache full"):
            await open_(reg, "B", 300)
        for session in a[:5]:
            reg.close(session.session_id)  # A is back at its share
        with pytest.raises(CapacityError, match="its share is 500"):
            await open_(reg, "A", 100)
        assert (await open_(reg, "B", 300)).owner == "B"  # the retry finds its space
        assert (await open_(reg, "A", 100)).owner == "A"  # B was served: A may borrow again

    asyncio.run(main())


def test_finding_11_waiting_opens_are_served_first_come_first_served():
    async def main():
        reg = registry()
        a = [await open_(reg, "A", 250) for _ in range(4)]
        b = await waiting(reg, "B", 200)
        c = await waiting(reg, "C", 200)
        reg.close(a[0].session_id)  # 250 free: room for one of them, the first
        assert (await b).owner == "B" and not c.done()
        d = await waiting(reg, "D", 50)  # it would fit in the 50 left, but C came first
        assert not d.done()
        reg.close(a[1].session_id)
        assert (await c).owner == "C" and (await d).owner == "D"

    asyncio.run(main())


def test_finding_11_a_borrower_never_holds_back_the_queue():
    async def main():
        reg = registry()
        a = [await open_(reg, "A", 100) for _ in range(4)]
        await open_(reg, "C", 600)  # the cache is full
        big = await waiting(reg, "A", 300)  # A would go to 700, beyond its share
        small = await waiting(reg, "B", 100)  # behind it, within B's share
        reg.close(a[0].session_id)  # 200 free: B's open fits, A's does not
        assert (await small).owner == "B" and not big.done()
        big.cancel()
        await asyncio.gather(big, return_exceptions=True)
        assert reg.opens_waiting == 0

    asyncio.run(main())


def test_finding_11_a_cancelled_wait_leaves_the_queue_and_lets_others_on():
    async def main():
        reg = registry()
        await open_(reg, "A", 900)
        first = await waiting(reg, "B", 300)  # holds back the next one (FIFO)
        second = await waiting(reg, "C", 100)
        assert not second.done()
        first.cancel()  # its client went away
        assert (await second).owner == "C"
        assert reg.opens_waiting == 0 and reg.tokens_free == 0

    asyncio.run(main())


def test_finding_11_share_one_lets_a_client_use_everything():
    async def main():
        reg = registry(share=1.0)
        b = await waiting(reg, "B", 1000)  # nothing to wait for: admitted at once
        assert (await b).owner == "B" and reg.tokens_free == 0

    asyncio.run(main())


def test_finding_11_a_session_id_cannot_be_taken_while_its_open_waits():
    async def main():
        reg = registry()
        await open_(reg, "A", 1000)
        req = request(100)
        queued = asyncio.ensure_future(reg.open(req, "B", SERVED, wait=LONG))
        while not reg.opens_waiting:
            await asyncio.sleep(0)
        with pytest.raises(RequestError, match="already used by another client"):
            await reg.open(req, "C", SERVED, wait=0)
        queued.cancel()
        await asyncio.gather(queued, return_exceptions=True)

    asyncio.run(main())
