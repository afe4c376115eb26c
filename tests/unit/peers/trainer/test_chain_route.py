"""The trainer's side of the chain: each stage's route neighbours per phase, the adjacent stages a run's open names,
and a replay's record filled from what the neighbours kept."""

from __future__ import annotations

import asyncio

import torch

from peers.trainer import chain
from peers.trainer.replay import StepRecord, fill
from peers.wire.messages import InferenceReply, TrainFetch
from swarm.records import PeerRecord, PeerState


def _record(peer_id: str, start: int, end: int) -> PeerRecord:
    return PeerRecord(peer_id=peer_id, model="m", start=start, end=end, state=PeerState.ONLINE, throughput=1.0)


def test_each_phase_names_the_route_neighbours():
    route = ["a", "b", "c"]
    forwards = chain.forward_messages("run", "0.1@1", route)
    assert [(m.upstream, m.downstream) for m in forwards] == [("", "b"), ("a", "c"), ("b", "")]
    backwards = chain.backward_messages("run", "0.1@1", route, [1.0, 2.0, 1.0])
    assert [(m.upstream, m.downstream, m.scale) for m in backwards] == [("b", "", 1.0), ("c", "a", 2.0),
                                                                       ("", "b", 1.0)]
    assert chain.forward_messages("run", "m", ["solo"])[0].upstream == ""  # one stage: a star of one


def test_a_stage_takes_pushes_from_every_replica_of_the_adjacent_stages():
    a, b1, b2, c = ("12D3KooW" + ch * 44 for ch in "ABCD")
    replicas = [[_record(a, 0, 2)], [_record(b1, 2, 4), _record(b2, 2, 4)], [_record(c, 4, 6)]]
    assert chain.neighbours(replicas, 0, 2) == ([], [b1, b2])
    assert chain.neighbours(replicas, 2, 4) == ([a], [c])
    assert chain.neighbours(replicas, 4, 6) == ([b1, b2], [])
    assert chain.neighbours(replicas, 1, 3) == ([], [])


class _Trainer:
    run_id = "run"

    def __init__(self, kept: dict[tuple[str, str, str], torch.Tensor]) -> None:
        self.kept, self.calls = kept, []

    async def _call(self, peer_id: str, message: TrainFetch, tensor):
        self.calls.append((peer_id, message.what))
        return InferenceReply(), self.kept[(peer_id, message.micro_id, message.what)]


def test_a_chain_replay_fetches_what_the_trainer_did_not_see_from_the_neighbours():
    record = StepRecord([(0, 2), (2, 4), (4, 6)])
    x, y, g = torch.ones(1, 2, 4), torch.full((1, 2, 4), 2.0), torch.full((1, 2, 4), 3.0)
    record.forward(1, 0, "b", None, None, micro_id="0.0@1", upstream="a", downstream="c")
    record.ran(1, 0)
    record.backward(1, 0, None, 0, ordered=False)
    share = record.stages[1]
    assert share.complete() and share.order == [0]
    trainer = _Trainer({("a", "0.0@1", "output"): x, ("c", "0.0@1", "input"): y, ("c", "0.0@1", "grad"): g})
    assert asyncio.run(fill(trainer, share))
    micro = share.micro[0]
    assert (micro.hidden, micro.output, micro.grad) == (x, y, g)
    assert sorted(trainer.calls) == [("a", "output"), ("c", "grad"), ("c", "input")]
    record.forward(1, 1, "b", None, None, micro_id="0.1@1", upstream="a", downstream="c")
    record.backward(1, 1, None, 0, ordered=False)
    assert not asyncio.run(fill(trainer, record.stages[1]))  # a neighbour forgot it: no replay
