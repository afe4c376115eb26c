"""What the estimator is given, measured here and never on the runs it is checked against (estimator.py).

* ``measure_compute``: a peer's compute per block, timed the way the peers run it (a one-token inference step
  with a KV cache under ``inference_mode``; ``StageTrainer``'s forward, backward and apply at the micro-batch's
  size), and the client's own part (embedding + head + argmax; embedding + head + loss and their backward; its
  AdamW step). Two measured sizes per operation, so the linear ``fixed + tokens x per_token`` model is exact at the
  sizes the benchmark uses.
* ``measure_stream_cpu``: CPU per message at each end (``tensor_messages`` + AES-GCM sealing + framing; parsing +
  unsealing + decoding), in this process, for a one-token tensor and a micro-batch's.
* ``measure_transit``: the rest of a round trip to a real peer on 127.0.0.1 (one process, its own p2p daemon):
  per message, wall time minus the peer's own compute minus the CPU above, for training calls of two sizes
  (``transit_s`` and the daemons' rate).

The machine is shared with other work (2 cores, other sessions' tests), and its load changes by the minute, so
``benchmarks/estimator.py`` measures compute again just before each case with plain medians (``rounds=1``: under
the load of that moment); the best-of-5-rounds figures (what a core does when it is free) are reported beside.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

import torch
from hivemind.proto import runtime_pb2

from peers.core.config import ClientConfig
from peers.model import ModelConfig
from peers.model.checkpoint import load_blocks, load_client_parts
from peers.model.local import default_position_ids
from peers.training import OptimConfig, PartOptimizer, loss_of, unique_parameters
from peers.training.stage import StageTrainer
from peers.wire.framing import encode, parse
from peers.wire.messages import TrainBackward, TrainForward, TrainOpen
from peers.wire.tensors import read_tensor_messages, sealer, tensor_messages, unsealer
from privacy.channel import ClientHandshake, accept_handshake, new_session_id
from privacy.identity import Identity
from swarm.estimator import ClientCompute, Compute, StreamCost
from swarm.measure import time_per_call

OPTIM = OptimConfig(lr=1e-4, clip_norm=1.0, weight_decay=0.01)


ROUNDS = 5  # timings are the best of this many rounds' medians: the machine is shared, and the estimator is
# given what a peer's device does when it has a core (other work on the machine only ever adds time)


def median_time(fn, repeats: int = 7, rounds: int = ROUNDS) -> float:
    """The best of ``rounds`` medians of ``repeats`` calls of ``fn``."""
    return min(time_per_call(fn, warmup=1, repeats=repeats) for _ in range(rounds))


def best_median(samples: list[float], rounds: int = ROUNDS) -> float:
    """The best median of ``rounds`` consecutive slices of ``samples``."""
    size = max(1, len(samples) // rounds)
    return min(statistics.median(samples[i:i + size]) for i in range(0, len(samples) - size + 1, size))


def measure_compute(model_dir: Path, *, context: int, rows: int, seq_len: int, rounds: int = ROUNDS
                    ) -> tuple[Compute, ClientCompute]:
    """Per block (block 0 stands for all: they have one shape) and the client's part, in seconds; ``rounds=1``:
    plain medians, under whatever else runs on the machine now."""
    cfg = ModelConfig.from_dir(model_dir)
    tokens = rows * seq_len
    with torch.inference_mode():
        blocks = load_blocks(model_dir, 0, 1)
        past_in = torch.randn(1, context, cfg.hidden_size)
        _, past = blocks(past_in, torch.arange(context)[None])
        one = torch.randn(1, 1, cfg.hidden_size)
        step = median_time(lambda: blocks(one, torch.tensor([[context]]), past), 300 // rounds, rounds)
    trainer = StageTrainer(load_blocks(model_dir, 0, 1), OPTIM, 1, auto_step=False)
    hidden = torch.randn(rows, seq_len, cfg.hidden_size)
    positions = default_position_ids(torch.zeros(rows, seq_len, dtype=torch.long))
    grad = torch.randn(rows, seq_len, cfg.hidden_size) * 1e-3
    counter = iter(range(10**9))

    def forward_backward() -> tuple[float, float]:
        micro = str(next(counter))
        t0 = time.perf_counter()
        trainer.forward(micro, hidden, positions)
        t1 = time.perf_counter()
        trainer.backward(micro, grad)
        return t1 - t0, time.perf_counter() - t1

    for _ in range(2):
        forward_backward()
    pairs = [forward_backward() for _ in range(25)]
    train_fwd = best_median([p[0] for p in pairs], rounds)
    train_bwd = best_median([p[1] for p in pairs], rounds)
    trainer.apply(trainer.micro_count)
    applies = []
    for _ in range(10):
        forward_backward()
        t0 = time.perf_counter()
        trainer.apply(trainer.micro_count)
        applies.append(time.perf_counter() - t0)
    per_token = max(0.0, (train_fwd - step) / (tokens - 1))
    block = Compute(forward_s=per_token, forward_fixed_s=max(0.0, step - per_token), backward_s=train_bwd / tokens,
                    apply_s=best_median(applies, rounds))
    return block, _client_compute(model_dir, rows, seq_len, rounds)


def _client_compute(model_dir: Path, rows: int, seq_len: int, rounds: int) -> ClientCompute:
    embedding, head = load_client_parts(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    token = torch.tensor([[1]])
    with torch.inference_mode():
        inference = median_time(lambda: head(embedding(token, torch.tensor([[8]])))[:, -1].argmax(-1), 100 // rounds,
                                rounds)
    for module in (embedding, head):
        module.requires_grad_(True).train()
    part = PartOptimizer(unique_parameters(embedding, head), OPTIM)
    ids = torch.randint(0, cfg.vocab_size, (rows, seq_len + 1))
    tokens = rows * seq_len

    def train_part() -> None:
        input_ids = ids[:, :-1]
        embedded = embedding.embed(input_ids, default_position_ids(input_ids))
        last = (embedded.detach() + 0.0).requires_grad_(True)  # stands for the last stage's output
        loss = loss_of(head.head(last), input_ids)
        grad, *head_grads = torch.autograd.grad(loss, [last, *part.params], allow_unused=True)
        embedding_grads = torch.autograd.grad(embedded, part.params, grad, allow_unused=True)
        part.add(head_grads, embedding_grads)

    train = median_time(train_part, 5, rounds)
    apply = median_time(part.step, 3, rounds)
    return ClientCompute(forward_s=0.0, fixed_s=inference, backward_s=max(0.0, train - inference) / tokens,
                         apply_s=apply)


def measure_stream_cpu(hidden_size: int, tokens: int) -> tuple[float, float, float, int]:
    """(send_s, recv_s, cpu_s_per_byte, frame_bytes) of one message, sealed as on our encrypted streams."""
    identity = Identity.generate()
    handshake = ClientHandshake(identity.public_bytes, new_session_id())
    reply, peer_channel = accept_handshake(handshake.hello(), identity)
    channel = handshake.finish(reply)
    seal, unseal = sealer(channel), unsealer(peer_channel)
    metadata = b"x" * 120  # a request's msgpack metadata is ~100-150 bytes
    results = {}
    for size in (1, tokens):
        tensor = torch.randn(1, size, hidden_size)
        sends, recvs, nbytes = [], [], 0
        for i in range(42):
            t0 = time.perf_counter()
            frames = [encode(m) for m in tensor_messages(tensor, metadata, seal=seal)]
            t1 = time.perf_counter()
            asyncio.run(_read(frames, unseal))
            t2 = time.perf_counter()
            if i >= 2:
                sends.append(t1 - t0)
                recvs.append(t2 - t1)
            nbytes = sum(len(f) for f in frames)
        recv_s = best_median(recvs) - _empty_asyncio_run()
        results[size] = (best_median(sends), recv_s, nbytes, tensor.numel() * 4)
    (s1, r1, b1, raw1), (s2, r2, b2, _) = results[1], results[tokens]
    per_byte = max(0.0, ((s2 - s1) + (r2 - r1)) / 2 / (b2 - b1))
    return max(0.0, s1 - b1 * per_byte), max(0.0, r1 - b1 * per_byte), per_byte, b1 - raw1


async def _read(frames: list[bytes], unseal) -> None:
    async def messages():
        for frame in frames:
            yield parse(runtime_pb2.ExpertRequest, frame[9:])  # after the marker and the 8-byte length

    await read_tensor_messages(messages(), 1 << 30, unseal=unseal)


def _empty_asyncio_run() -> float:
    async def nothing() -> None:
        return None

    return median_time(lambda: asyncio.run(nothing()))


def measure_transit(model_dir: Path, workdir: Path, *, cpu: tuple[float, float, float, int], rows: int,
                    seq_len: int) -> tuple[StreamCost, dict]:
    """Round trips to one real peer on 127.0.0.1 serving the whole model: ``TrainForward``/``TrainBackward`` calls of
    one token and of a micro-batch, one at a time. Their wall time minus the peer's own ``compute_ms`` minus the CPU
    per message, halved, is ``transit_s + bytes / daemon_rate`` (two sizes: both). The peer's compute is taken out
    by the peer's own clock, so however slow the shared machine makes the compute, it does not count as transit."""
    from peers.cli.launch import LocalSwarm
    from peers.client.swarm_client import SwarmClient

    send_s, recv_s, per_byte, frame = cpu
    cfg = ModelConfig.from_dir(model_dir)
    with LocalSwarm(workdir / "calibration", train=True) as swarm:
        swarm.start_dht()
        peer = swarm.start_peer(model_dir, block_indices=f"0:{cfg.num_layers}")
        config = ClientConfig(swarm=swarm.trainer_config(), request_timeout=60)
        with SwarmClient(model_dir, config=config) as client_node:
            client_node.wait_for_records(1)
            small = client_node.loop.run(_train_calls(client_node, peer.peer_id, 1, 1, cfg))
            big = client_node.loop.run(_train_calls(client_node, peer.peer_id, rows, seq_len, cfg))
    sizes = (cfg.hidden_size * 4 + frame, rows * seq_len * cfg.hidden_size * 4 + frame)
    per_message = [(overhead - 2 * (send_s + recv_s + size * per_byte)) / 2 for overhead, size in zip(
        (small, big), sizes, strict=True)]
    slope = (per_message[1] - per_message[0]) / (sizes[1] - sizes[0])
    rate = 1 / slope if slope > 0 else 1e12  # no time per byte to be seen beyond the CPU's: unlimited
    transit = max(0.0, per_message[0] - sizes[0] * max(slope, 0.0))
    raw = {"train_call_overhead_s": {"1x1": small, f"{rows}x{seq_len}": big}, "message_bytes": list(sizes)}
    return StreamCost(send_s=send_s, recv_s=recv_s, cpu_s_per_byte=per_byte, transit_s=transit, daemon_rate=rate,
                      frame_bytes=frame), raw


async def _train_calls(client, peer_id: str, rows: int, seq_len: int, cfg: ModelConfig) -> float:
    """Median wall time minus the peer's compute of a micro-batch's training forwards and backwards, one at a time."""
    stream, run = await client.peer_stream(peer_id), f"calibrate-{rows}x{seq_len}"
    await stream.call(TrainOpen(run_id=run, start=0, end=cfg.num_layers, optim=OPTIM.to_dict(),
                                accumulation=1000, keep_activations=True, explicit_apply=True), None, 60)
    hidden = torch.randn(rows, seq_len, cfg.hidden_size)
    samples = []
    for i in range(24):
        micro = f"0.{i}"
        for message, tensor in ((TrainForward(run_id=run, micro_id=micro), hidden),
                                (TrainBackward(run_id=run, micro_id=micro), hidden * 1e-3)):
            t0 = time.perf_counter()
            reply, _ = await stream.call(message, tensor, 60)
            samples.append(time.perf_counter() - t0 - reply.compute_ms / 1e3)
    return best_median(samples[4:])
