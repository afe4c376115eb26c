"""The chain's inbox of pushed tensors and a session's kept outputs (pure, in-process)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from peers.server.inbox import Inbox
from peers.server.kv_sessions import Session
from peers.wire.errors import RequestError


def test_a_push_before_or_after_its_request_meets_it():
    async def go():
        inbox = Inbox()
        early = torch.ones(1, 1, 4)
        inbox.put(("s", 0), early)
        assert await inbox.take(("s", 0), 1.0) is early
        waiting = asyncio.ensure_future(inbox.take(("s", 1), 1.0))
        await asyncio.sleep(0)
        late = torch.zeros(1, 1, 4)
        inbox.put(("s", 1), late)
        assert await waiting is late
        assert len(inbox) == 0

    asyncio.run(go())


def test_an_untaken_push_is_replaced_and_a_missing_one_times_out():
    async def go():
        inbox = Inbox()
        inbox.put(("s", 0), torch.ones(1, 1, 4))
        inbox.put(("s", 0), torch.full((1, 1, 4), 2.0))  # a retry pushes the same step again: the later one wins
        assert (await inbox.take(("s", 0), 1.0)).eq(2).all()
        with pytest.raises(RequestError, match="did not arrive within"):
            await inbox.take(("s", 5), 0.05, "the input of s")
        assert len(inbox) == 0

    asyncio.run(go())


def test_a_full_inbox_refuses_and_failing_a_session_wakes_its_waiter():
    async def go():
        inbox = Inbox(max_entries=2, max_bytes=1 << 20)
        inbox.put(("a", 0), torch.ones(1, 1, 4))
        inbox.put(("b", 0), torch.ones(1, 1, 4))
        with pytest.raises(RequestError, match="inbox of pushed tensors is full"):
            inbox.put(("c", 0), torch.ones(1, 1, 4))
        big = Inbox(max_bytes=100)
        with pytest.raises(RequestError, match="full"):
            big.put(("a", 0), torch.ones(1, 100))
        waiting = asyncio.ensure_future(inbox.take(("a", 1), 5.0))
        await asyncio.sleep(0)
        assert inbox.fail(lambda key: key[0] == "a", "session 'a' was closed") == 2
        with pytest.raises(RequestError, match="was closed"):
            await waiting
        inbox.drop_untaken(lambda key: key[0] == "b")
        assert len(inbox) == 0

    asyncio.run(go())


def _session() -> Session:
    return Session("s", "owner", 0, 8, max_length=32, batch_size=1, downstream="next", downstream_session="t")


def test_kept_outputs_follow_the_cache_and_its_rollbacks():
    session = _session()
    prompt, one, two = torch.randn(1, 5, 4), torch.randn(1, 1, 4), torch.randn(1, 1, 4)
    session.keep(0, prompt)
    session.length = 5
    session.keep(5, one)
    session.length = 6
    assert torch.equal(session.kept_outputs(6), torch.cat([prompt, one], dim=1))
    assert torch.equal(session.kept_outputs(3), prompt[:, :3])
    session.keep(5, two)  # the step at 5 again (a retry): its new output replaces the old one
    assert torch.equal(session.kept_outputs(6), torch.cat([prompt, two], dim=1))
    session.past = [(torch.zeros(1, 1, 6, 2), torch.zeros(1, 1, 6, 2))]  # the KV cache of its 6 tokens
    session.truncate(2)
    assert session.kept_outputs(3) is None and torch.equal(session.kept_outputs(2), prompt[:, :2])
    assert _session().kept_outputs(1) is None
