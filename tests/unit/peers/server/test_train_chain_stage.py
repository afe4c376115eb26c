"""The chain side of a stage (``peers.server.training_chain``), two ``TrainingRPC`` in one process whose pushes go
straight to each other: chained forwards/backwards equal the blocks' own math, pushes only from named neighbours,
a re-open fails pending waits at once, a failed push names its peer, computes run in arrival order."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from peers.core.trainers import TrainerPolicy
from peers.model import load_blocks, make_tiny_model
from peers.server.training_chain import _Turns
from peers.server.training_rpc import TrainingRPC
from peers.training import OptimConfig
from peers.wire.errors import ChainError, RequestError
from peers.wire.messages import InferenceReply, StageInfo, TrainApply, TrainBackward, TrainForward, TrainOpen, TrainPush
from swarm.compression import Encoded, decode
from swarm.compression.codecs import CODED

A, B, STRANGER = ("12D3KooW" + c * 44 for c in "ABC")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("train-chain") / "tiny", hidden_size=32, num_layers=2,
                           num_heads=2, num_kv_heads=1, intermediate_size=64)


class _Link:
    """``PeerStream.call`` of a push, delivered straight into the other stage (or failing, if it is gone)."""

    def __init__(self, rpcs: dict[str, TrainingRPC], sender: str, target: str) -> None:
        self.rpcs, self.sender, self.target = rpcs, sender, target

    async def call(self, message: TrainPush, tensor: torch.Tensor, timeout: float):
        if self.target not in self.rpcs:
            raise ConnectionError("peer gone")
        self.rpcs[self.target].receive_push(message, tensor, self.sender)
        return InferenceReply(), None


def _pair(model_dir: Path) -> dict[str, TrainingRPC]:
    rpcs: dict[str, TrainingRPC] = {}
    for peer, start in ((A, 0), (B, 1)):
        info = StageInfo(peer_id=peer, model="tiny", start=start, end=start + 1, hidden_size=32, dtype="float32",
                         max_batch_size=8, max_seq_len=64, max_request_bytes=1 << 20, throughput=1.0, version="t")

        async def stream_for(target: str, sender: str = peer) -> _Link:
            return _Link(rpcs, sender, target)

        rpcs[peer] = TrainingRPC(load_blocks(model_dir, start, start + 1), info, trainers=TrainerPolicy(("anyone",)),
                                 stream_for=stream_for, chain_timeout=5.0)
    return rpcs


def _open(rpc: TrainingRPC, stream: object, compression: str = "none", **chain: list[str]):
    start = rpc.info.start
    request = TrainOpen(run_id="run", start=start, end=start + 1, optim=OptimConfig().to_dict(), accumulation=1,
                        explicit_apply=True, compression=compression, **chain)
    return rpc.open(request, stream)


def test_a_chained_micro_batch_equals_the_blocks_and_a_step_keeps_what_was_exchanged(model_dir):
    rpcs, ta, tb = _pair(model_dir), object(), object()
    hidden, grad = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    positions = torch.arange(5).expand(2, 5)
    leaf = hidden.clone().requires_grad_(True)
    expected = rpcs[B].blocks(rpcs[A].blocks(leaf, positions)[0], positions)[0]
    expected_grad, = torch.autograd.grad(expected, leaf, grad)

    async def scenario():
        await _open(rpcs[A], ta, downstream=[B])
        await _open(rpcs[B], tb, upstream=[A])
        waiting = asyncio.ensure_future(rpcs[B].chain.run(TrainForward(run_id="run", micro_id="m", upstream=A),
                                                         None, tb))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # its input comes by push
        pushed, _ = await rpcs[A].chain.run(TrainForward(run_id="run", micro_id="m", downstream=B), hidden, ta)
        assert pushed is None  # went to B, not back to the trainer
        output, compute_ms = await waiting
        assert compute_ms > 0
        first = asyncio.ensure_future(rpcs[A].chain.run(TrainBackward(run_id="run", micro_id="m", upstream=B),
                                                       None, ta))
        await rpcs[B].chain.run(TrainBackward(run_id="run", micro_id="m", downstream=A, scale=2.0), grad, tb)
        grad_input, _ = await first
        for rpc, stream in ((rpcs[A], ta), (rpcs[B], tb)):
            await rpc.apply(TrainApply(run_id="run", micro_batches=1), stream)
        return output, grad_input

    output, grad_input = asyncio.run(scenario())
    assert torch.equal(output, expected.detach())
    assert torch.allclose(grad_input, expected_grad, atol=1e-6)  # B scaled the grad by 2 and its input's back
    # kept for a replay: A's pushed output is B's input; B's pushed grad; nothing of what the trainer saw
    assert torch.equal(rpcs[A].chain.kept("m", "output"), rpcs[B].chain.kept("m", "input"))
    assert rpcs[B].chain.kept("m", "grad").shape == hidden.shape
    with pytest.raises(RequestError, match="kept no input"):
        rpcs[A].chain.kept("m", "input")


def test_pushes_only_from_named_neighbours_and_routes_only_through_them(model_dir):
    rpcs, tb = _pair(model_dir), object()

    async def scenario():
        with pytest.raises(RequestError, match="not open on this peer"):
            rpcs[B].receive_push(TrainPush(run_id="run", micro_id="m"), torch.zeros(1, 2, 32), A)
        await _open(rpcs[B], tb, upstream=[A])
        with pytest.raises(RequestError, match="is not a previous stage"):
            rpcs[B].receive_push(TrainPush(run_id="run", micro_id="m"), torch.zeros(1, 2, 32), STRANGER)
        with pytest.raises(RequestError, match="is not a next stage"):  # A may push inputs, not grads
            rpcs[B].receive_push(TrainPush(run_id="run", micro_id="m", backward=True), torch.zeros(1, 2, 32), A)
        with pytest.raises(RequestError, match="was not named"):
            rpcs[B].check_chained(TrainForward(run_id="run", micro_id="m", upstream=STRANGER), tb)
        with pytest.raises(RequestError, match="recomputes from the input"):
            rpcs[B].check_chained(TrainBackward(run_id="run", micro_id="m", downstream=A, recompute=True), tb)
        with pytest.raises(RequestError, match="scale must be"):
            rpcs[B].check_chained(TrainBackward(run_id="run", micro_id="m", downstream=A, scale=float("nan")), tb)
        with pytest.raises(RequestError, match="not open on this stream"):
            rpcs[B].check_chained(TrainForward(run_id="run", micro_id="m", upstream=A), object())
        with pytest.raises(RequestError, match="reply_codec: "):
            rpcs[B].check_chained(TrainForward(run_id="run", micro_id="m", upstream=A, reply_codec="zip"), tb)
        with pytest.raises(RequestError, match="this one goes to a peer"):
            rpcs[B].check_chained(TrainBackward(run_id="run", micro_id="m", downstream=A, reply_codec="int8"), tb)
        rpcs[B].receive_push(TrainPush(run_id="run", micro_id="m"), torch.zeros(1, 2, 32), A)  # accepted

    asyncio.run(scenario())


@pytest.mark.parametrize("setting, reply_codec, expected", [
    ("adaptive", "int8", "int8"),  # the trainer measured its link: its choice for the reply
    ("adaptive", "none", None),  # the trainer's link is fast enough: as it is
    ("adaptive", "", "topk"),  # an older trainer says nothing: the stage's own choice, an unmeasured (slow) link
    ("none", "int8", None),  # a bit-exact run never goes lossy
])
def test_a_reply_to_the_trainer_travels_in_the_codec_the_trainer_chose(model_dir, setting, reply_codec, expected):
    rpcs, tb = _pair(model_dir), object()

    async def scenario():
        await _open(rpcs[B], tb, compression=setting)
        return await rpcs[B].chain.run(TrainForward(run_id="run", micro_id="m", reply_codec=reply_codec),
                                       torch.randn(2, 5, 32), tb)

    payload, _ = asyncio.run(scenario())
    if expected is None:
        assert isinstance(payload, torch.Tensor)
    else:
        assert isinstance(payload, Encoded) and payload.serialized.compression == CODED
        assert decode(payload.serialized, max_bytes=1 << 20).tensor.shape == (2, 5, 32)
        assert [codec.split(":")[0] for codec in rpcs[B].chain.compression.sent] == [expected]


def test_a_re_open_fails_pending_waits_at_once_and_a_failed_push_names_the_peer(model_dir):
    rpcs, ta, tb = _pair(model_dir), object(), object()

    async def scenario():
        await _open(rpcs[B], tb, upstream=[A])
        waiting = asyncio.ensure_future(rpcs[B].chain.run(TrainForward(run_id="run", micro_id="m", upstream=A),
                                                         None, tb))
        await asyncio.sleep(0.05)
        await _open(rpcs[B], tb, upstream=[A])  # the trainer retries: the old attempt's wait fails now
        with pytest.raises(RequestError, match="re-opened"):
            await asyncio.wait_for(waiting, 1.0)
        waiting = asyncio.ensure_future(rpcs[B].chain.run(TrainForward(run_id="run", micro_id="n", upstream=A),
                                                         None, tb))
        await asyncio.sleep(0.05)
        rpcs[B].stream_closed(tb)  # the trainer's stream closed
        with pytest.raises(RequestError, match="stream closed"):
            await asyncio.wait_for(waiting, 1.0)
        await _open(rpcs[A], ta, downstream=[B])
        del rpcs[B]  # B is gone: A's push fails, and A's reply names B
        with pytest.raises(ChainError) as failed:
            await rpcs[A].chain.run(TrainForward(run_id="run", micro_id="m", downstream=B), torch.randn(1, 3, 32), ta)
        assert failed.value.failed_peer == B

    asyncio.run(scenario())


def test_chained_requests_compute_in_arrival_order_whatever_order_their_inputs_come_in():
    turns, ran = _Turns(), []

    async def request(name: str, ready: asyncio.Event) -> None:
        previous, mine = turns.take()
        try:
            await ready.wait()
            await turns.wait(previous)
            ran.append(name)
        finally:
            turns.release(previous, mine)

    async def scenario():
        events = [asyncio.Event() for _ in range(3)]
        tasks = [asyncio.ensure_future(request(str(i), events[i])) for i in range(3)]
        await asyncio.sleep(0)
        events[2].set()
        events[1].set()
        await asyncio.sleep(0.01)
        assert ran == []  # the first one's input has not come
        tasks[0].cancel()  # the first gives up: the others go on, in order
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())
    assert ran == ["1", "2"]


def test_a_re_open_stops_a_push_to_a_peer_that_does_not_answer(model_dir):
    """Its reply (and the re-open's, after it on the trainer's stream) must not wait for a dead peer's dial."""
    rpcs, ta = _pair(model_dir), object()

    async def hang(peer: str):
        await asyncio.sleep(100)

    async def scenario():
        await _open(rpcs[A], ta, downstream=[B])
        rpcs[A].chain.stream_for = hang
        pushing = asyncio.ensure_future(rpcs[A].chain.run(TrainForward(run_id="run", micro_id="m", downstream=B),
                                                         torch.randn(1, 3, 32), ta))
        await asyncio.sleep(0.2)
        assert not pushing.done()
        await _open(rpcs[A], ta, downstream=[B])
        with pytest.raises(RequestError, match="stopped: run 'run' was re-opened"):
            await asyncio.wait_for(pushing, 1.0)

    asyncio.run(scenario())


def test_a_forward_does_not_wait_for_the_grad_of_an_earlier_backward(model_dir):
    """Forwards and backwards keep an order each, not one between them: a slow link's two directions both stay
    busy (with one order a forward waited until an earlier micro-batch's grad had crossed the other way)."""
    rpcs, ta, tb = _pair(model_dir), object(), object()
    hidden, grad = torch.randn(2, 5, 32), torch.randn(2, 5, 32)

    async def scenario():
        await _open(rpcs[A], ta, downstream=[B])
        await _open(rpcs[B], tb, upstream=[A])
        b_first = asyncio.ensure_future(rpcs[B].chain.run(TrainForward(run_id="run", micro_id="m0", upstream=A),
                                                         None, tb))
        await rpcs[A].chain.run(TrainForward(run_id="run", micro_id="m0", downstream=B), hidden, ta)
        await b_first
        backward = asyncio.ensure_future(rpcs[A].chain.run(TrainBackward(run_id="run", micro_id="m0", upstream=B),
                                                          None, ta))  # its grad has not come from B yet
        b_second = asyncio.ensure_future(rpcs[B].chain.run(TrainForward(run_id="run", micro_id="m1", upstream=A),
                                                          None, tb))
        pushed, _ = await asyncio.wait_for(
            rpcs[A].chain.run(TrainForward(run_id="run", micro_id="m1", downstream=B), hidden * 2, ta), 5.0)
        assert pushed is None and not backward.done()  # m1's forward went by while m0's backward waits
        await asyncio.wait_for(b_second, 5.0)
        await rpcs[B].chain.run(TrainBackward(run_id="run", micro_id="m0", downstream=A), grad, tb)
        grad_input, _ = await asyncio.wait_for(backward, 5.0)
        assert grad_input.shape == hidden.shape

    asyncio.run(scenario())
