"""Compressed training in a chain (issue 14) on real processes: different codecs on different links of one pipeline
(the run's setting for the trainer and the last stage, a per-stage setting for the first two: ``SwarmTrainer``'s
``stage_compression``), the grad of a top-k'd forward back in the same pattern, the loss going down, and a malformed
compressed push refused with a clear error while the run goes on."""

from __future__ import annotations

import pytest
import torch

from peers.cli.launch import LocalSwarm, SwarmProcess
from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig, SwarmConfig
from peers.trainer.swarm_trainer import SwarmTrainer
from peers.training import OptimConfig, TokenBatches, encode_bytes
from peers.wire.errors import RequestError
from peers.wire.messages import TrainFetch, TrainPush
from swarm.compression import Codec, Encoded, encode
from swarm.compression.codecs import INT8_BLOCK

OPTIM = OptimConfig(lr=3e-3, warmup_steps=1, schedule="constant", clip_norm=1.0, weight_decay=0.0)
TEXT = "A slow link carries a few of the values; the stages keep up with each other. " * 40
ACCUMULATION = 2
TOPK = 0.5


@pytest.fixture(scope="module")
def swarm_and_peers(train_stages) -> tuple[LocalSwarm, dict[str, SwarmProcess]]:
    """Stage peers stage0 (0:3), stage1 (3:6) and stage2 (6:8), shared with other modules (``conftest.py``): the
    runs here have run ids of their own, and what they check holds from any weights (the loss falls on a batch
    trained on 8 times)."""
    return train_stages


def _client(swarm: LocalSwarm, llama_dir) -> SwarmClient:
    client = SwarmClient(llama_dir, config=ClientConfig(swarm=swarm.trainer_config(), request_timeout=20))
    client.wait_for_records(3)
    return client


def _kept(trainer: SwarmTrainer, stage: int, micro_id: str, what: str) -> torch.Tensor:
    """What stage ``stage`` kept of micro-batch ``micro_id`` in its last applied step (a chain replay's fetch)."""
    peer = trainer.stages[stage].peer_id
    _, tensor = trainer.client.loop.run(trainer._call(peer, TrainFetch(run_id=trainer.run_id, micro_id=micro_id,
                                                                        what=what), None))
    assert tensor is not None
    return tensor


def _int8_levels(tensor: torch.Tensor) -> bool:
    """Whether every block of ``INT8_BLOCK`` values is a multiple of its absmax / 127 (what int8 decodes to)."""
    flat = tensor.float().reshape(-1)
    flat = torch.nn.functional.pad(flat, (0, -flat.numel() % INT8_BLOCK)).view(-1, INT8_BLOCK)
    scale = (flat.abs().amax(dim=1, keepdim=True) / 127).clamp_min(1e-30)
    steps = flat / scale
    return bool(((steps - steps.round()).abs() < 1e-3).all())


def test_mixed_codecs_per_link_train_and_grads_follow_the_topk_pattern(swarm_and_peers, llama_dir):
    """Trainer -> stage0: fp16; stage0 -> stage1: top-k (stage0's setting); stage1 -> stage2: int8 (stage1's);
    stage2 -> trainer: fp16 (the run's). stage1 sends its input's grad back in the pattern it received."""
    swarm, _ = swarm_and_peers
    with _client(swarm, llama_dir) as client:
        trainer = SwarmTrainer(client, OPTIM, ACCUMULATION, in_flight=2, run_id="mixed", compression="fp16",
                               stage_compression={0: f"topk:{TOPK}", 1: "int8"})
        trainer.start()
        data = TokenBatches(encode_bytes(TEXT), seq_len=16, micro_batch=2, seed=5)
        fixed = [data.next_micro() for _ in range(ACCUMULATION)]  # the same batch every step: the loss must fall
        losses = [trainer.train_step(fixed).loss for _ in range(8)]
        assert all(torch.isfinite(torch.tensor(losses)))
        assert losses[-1] < losses[0] - 0.05, losses
        micro_bytes = sum(m[:, :-1].numel() * 64 * 4 for m in fixed) * 8  # fp32 hidden states of the 8 steps
        assert trainer.bytes_sent < 0.6 * 2 * micro_bytes  # the trainer's two tensors per micro-batch in fp16
        assert trainer.compression.sent == {"fp16": 2 * ACCUMULATION * 8}

        micro_id = f"{trainer.steps_done - 1}.0@{trainer.attempt}"
        pushed = _kept(trainer, 0, micro_id, "output")  # what stage1 decoded of stage0's top-k push
        assert torch.equal(pushed, _kept(trainer, 1, micro_id, "input"))
        kept = pushed.reshape(-1) != 0
        assert int(kept.sum()) == pytest.approx(TOPK * pushed.numel(), abs=1)
        grad = _kept(trainer, 1, micro_id, "grad")  # stage1's input grad, pushed back to stage0
        assert grad.shape == pushed.shape and not bool(grad.reshape(-1)[~kept].any())  # only in the pattern
        assert bool(grad.reshape(-1)[kept].any())
        middle = _kept(trainer, 1, micro_id, "output")  # stage1 -> stage2 in int8
        assert torch.equal(middle, _kept(trainer, 2, micro_id, "input")) and _int8_levels(middle)
        assert not _int8_levels(torch.randn(4, INT8_BLOCK))  # the check can fail


def test_a_malformed_compressed_push_is_refused_and_the_run_goes_on(swarm_and_peers, llama_dir):
    swarm, procs = swarm_and_peers
    with _client(swarm, llama_dir) as client:
        trainer = SwarmTrainer(client, OPTIM, ACCUMULATION, in_flight=1, run_id="malformed", compression="int8")
        trainer.start()
        data = TokenBatches(encode_bytes(TEXT), seq_len=16, micro_batch=2, seed=6)
        trainer.train_step([data.next_micro() for _ in range(ACCUMULATION)])
        config = ClientConfig(swarm=SwarmConfig(initial_peers=tuple(swarm.initial_peers)), request_timeout=10)
        with SwarmClient(llama_dir, config=config) as stranger:
            stranger.wait_for_records(3)
            stream = stranger.loop.run(stranger.peer_stream(procs["stage1"].peer_id))
            good = encode(torch.randn(2, 16, 64), Codec.parse("topk:0.1/int8"))
            truncated = type(good.serialized)()
            truncated.CopyFrom(good.serialized)
            truncated.buffer = truncated.buffer[:-3]
            for bad in (Encoded(truncated),):
                with pytest.raises(RequestError, match="malformed coded tensor"):
                    stranger.loop.run(stream.call(TrainPush(run_id="malformed", micro_id="1.0@2"), bad, 10))
        result = trainer.train_step([data.next_micro() for _ in range(ACCUMULATION)])  # the run goes on
        assert result.stage_steps == [2, 2, 2]
    assert "malformed coded tensor" in procs["stage1"].log()
