"""ReplicaAverager: rounds, refusals and the outer step (two averagers wired in-process)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from peers.server.averaging import MAX_ROUNDS_AHEAD, ReplicaAverager, round_at

A, B = "12D3KooWAAAAAAAA", "12D3KooWBBBBBBBB"


class _Direct:
    """Stands in for a PeerStream: delivers a push straight into the other averager."""

    def __init__(self, sender: str, target: ReplicaAverager, numel: int) -> None:
        self.sender, self.target, self.numel = sender, target, numel

    async def call(self, message, tensor, timeout):
        self.target.receive(self.sender, message.round, tensor, self.numel)
        return None, None


def _pair(numel: int, **options) -> tuple[ReplicaAverager, ReplicaAverager]:
    averagers: dict[str, ReplicaAverager] = {}

    def stream_for(sender: str):
        async def get(peer: str):
            return _Direct(sender, averagers[peer], numel)
        return get

    averagers[A] = ReplicaAverager(A, "run", [B], stream_for(A), timeout=5, **options)
    averagers[B] = ReplicaAverager(B, "run", [A], stream_for(B), timeout=5, **options)
    return averagers[A], averagers[B]


def test_plain_averaging_gives_both_replicas_the_same_mean():
    a, b = _pair(3)
    x, y = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([3.0, 2.0, 1.0 / 3])

    async def round_():
        return await asyncio.gather(a.average(x), b.average(y))

    new_a, new_b = asyncio.run(round_())
    assert torch.equal(new_a, new_b) and torch.allclose(new_a, (x + y) / 2)
    assert a.rounds == b.rounds == 1 and a.last_group == 2


def test_outer_nesterov_step_is_identical_on_both_replicas():
    start = torch.tensor([1.0, 1.0])  # both replicas opened the run with these parameters
    a, b = _pair(2, outer_lr=0.7, outer_momentum=0.9, anchor=start)

    async def two_rounds():
        first = await asyncio.gather(a.average(start + torch.tensor([0.1, 0.0])), b.average(start))
        second = await asyncio.gather(a.average(first[0] - 0.1), b.average(first[1] + 0.1))
        return first, second

    first, second = asyncio.run(two_rounds())
    assert torch.equal(first[0], first[1]) and torch.equal(second[0], second[1])
    # round one: delta = anchor - mean = [-0.05, 0]; Nesterov: delta + 0.9 * delta; new = anchor - 0.7 * that
    assert torch.allclose(first[0], torch.tensor([1.0 + 0.7 * 1.9 * 0.05, 1.0]))


def test_a_silent_replica_is_left_out_after_the_timeout():
    lonely = ReplicaAverager(A, "run", [B], lambda peer: _never(), timeout=0.2)
    flat = torch.tensor([4.0, 5.0])
    assert torch.equal(asyncio.run(lonely.average(flat)), flat) and lonely.last_group == 1


async def _never():
    raise ConnectionError("unreachable")


class _Silent:
    """A stream whose peer never answers (its push times out)."""

    async def call(self, message, tensor, timeout):
        await asyncio.sleep(timeout)
        raise TimeoutError("no reply")


def test_an_unreachable_replica_is_not_waited_for():
    """A replica whose stream cannot be opened is dead: the round goes on at once, not after the timeout."""
    c = "12D3KooWCCCCCCCC"
    averagers: dict[str, ReplicaAverager] = {}

    def stream_for(sender: str):
        async def get(peer: str):
            if peer == c:
                raise ConnectionError("peer is gone")
            return _Direct(sender, averagers[peer], 2)
        return get

    averagers[A] = ReplicaAverager(A, "run", [B, c], stream_for(A), timeout=600)
    averagers[B] = ReplicaAverager(B, "run", [A, c], stream_for(B), timeout=600)
    x, y = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])

    async def round_():  # a wait for the 600 s timeout would fail here
        return await asyncio.wait_for(asyncio.gather(averagers[A].average(x), averagers[B].average(y)), 60)

    new_a, new_b = asyncio.run(round_())
    assert torch.equal(new_a, new_b) and torch.equal(new_a, (x + y) / 2) and averagers[A].last_group == 2

    silent = ReplicaAverager(A, "run", [B], lambda peer: _stream(_Silent()), timeout=0.3)  # reachable, mute
    assert torch.equal(asyncio.run(silent.average(x)), x) and silent.last_group == 1


async def _stream(stream):
    return stream


@pytest.mark.parametrize("sender, flat, message", [
    ("12D3KooWstranger", torch.zeros(2), "not a replica"),
    (B, torch.zeros(3), "flat float tensor of 2"),
    (B, torch.zeros(1, 2), "flat float tensor of 2"),
    (B, torch.tensor([1.0, float("nan")]), "NaN or infinite"),
    (B, torch.tensor([1, 2]), "flat float tensor"),
])
def test_bad_pushes_are_refused(sender, flat, message):
    averager = ReplicaAverager(A, "run", [B], lambda peer: _never(), timeout=1)
    with pytest.raises(ValueError, match=message):
        averager.receive(sender, 0, flat, 2)


def test_pushes_far_ahead_are_refused_so_a_replica_cannot_fill_memory():
    averager = ReplicaAverager(A, "run", [B], lambda peer: _never(), timeout=1)
    for round_ in range(MAX_ROUNDS_AHEAD + 1):
        averager.receive(B, round_, torch.zeros(2), 2)
    with pytest.raises(ValueError, match="too far ahead"):
        averager.receive(B, MAX_ROUNDS_AHEAD + 1, torch.zeros(2), 2)
    assert len(averager._inbox) == MAX_ROUNDS_AHEAD + 1


def test_finding_chaos_replicas_whose_rounds_differ_do_not_wait_out_the_timeout_for_each_other():
    """A rejoining replica's averager is new; rounds are named by steps (``round_at``), so it starts at the run's
    round. Should two replicas still disagree (B pushes round 0 while A is at round 3), A refuses B's push as over
    and does not wait for B, and B, refused, does not wait for A: no one waits out the 600 s timeout."""
    averagers: dict[str, ReplicaAverager] = {}

    def stream_for(sender: str):
        async def get(peer: str):
            return _Direct(sender, averagers[peer], 2)
        return get

    averagers[A] = ReplicaAverager(A, "run", [B], stream_for(A), timeout=600, first_round=round_at(12, 4))
    averagers[B] = ReplicaAverager(B, "run", [A], stream_for(B), timeout=600)
    x, y = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])

    async def misaligned():
        return await asyncio.wait_for(asyncio.gather(averagers[A].average(x, round_at(12, 4)),
                                                     averagers[B].average(y, 0)), 60)

    new_a, new_b = asyncio.run(misaligned())
    assert torch.equal(new_a, x) and torch.equal(new_b, y)  # each averaged alone, at once
    assert averagers[A].rounds == 4 and averagers[B].rounds == 1
