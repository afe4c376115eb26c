"""Fuzz a live peer over real hivemind streams; print JSON: what it refused, whether it kept serving, its memory.

    python benchmarks/fuzz_peer.py [--messages 10000] [--batch 1000] [--streams 8] [--seed 0] [--workdir DIR]

Starts a bootstrap node and one stage peer (blocks 0:8 of a tiny Llama) as real processes, then sends
``--messages`` fuzzed messages on the peer's binary stream handle (``fusionswarm.StageService.rpc_inference``,
hivemind's frames: a marker byte, an 8-byte big-endian length, protobuf): malformed metadata, wrong kinds and
field types, bad tensors (dtypes, shapes, sizes, compression, sealing), chunk counts above and below what is
sent, raw bytes, bad markers, undecodable and truncated frames, and a frame that declares 2^40 bytes followed by
some MiB. Every ``--batch`` messages a well-behaved client checks that a forward through the peer (on a stream
opened at the start and on a fresh one) equals a local forward of the same blocks, and the peer's RSS is sampled
from /proc. At the end ``--partial_frames`` streams each send all but the last byte of a frame of the peer's
largest size and wait, and the tracebacks in the peer's log are counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

import msgpack
import torch
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from peers.cli.launch import LocalSwarm
from peers.model import load_blocks, make_tiny_model
from peers.wire.framing import ERROR, MAX_FRAME_BYTES, encode, end_of_stream, read_frame
from peers.wire.messages import INFERENCE_KINDS, InferenceHello, InferenceReply, pack_inference
from peers.wire.service import INFERENCE_HANDLE
from peers.wire.stream import PeerStream
from peers.wire.tensors import serialize, tensor_messages
from privacy.channel import ClientHandshake, new_session_id
from privacy.peer_ids import public_key_of
from swarm.discovery import fetch_records, start_node

MODEL = dict(family="llama", hidden_size=64, num_layers=8, num_heads=4, num_kv_heads=2, intermediate_size=128)
HIDDEN, SPAN = MODEL["hidden_size"], (0, 8)
EDGE_INTS = [0, 1, -1, 7, (1 << 63) - 1, -(1 << 63), (1 << 64) - 1, 1 << 62]
DEEP = [b"\x91" * 1000 + b"\xc0", b"\x81\xa1k" * 1000 + b"\xc0"]  # msgpack reads 1024 levels; repr recurses
MAX_FRAME = MAX_FRAME_BYTES  # the peer's frame cap


class Fuzzer:
    """Random bad requests, as lists of frames (bytes) to write on a stream."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def value(self, depth: int = 0):
        """Any msgpack value: edge ints (up to 2^64 - 1), NaN, str vs bytes, lists and maps 2 levels deep."""
        r = self.rng
        return [lambda: None, lambda: r.random() < 0.5, lambda: r.choice(EDGE_INTS),
                lambda: r.choice([float("nan"), float("inf"), 1.5, -0.0]),
                lambda: "".join(r.choice("ab\u00e9\u2713 ") for _ in range(r.randrange(8))),
                lambda: r.randbytes(r.randrange(8)), lambda: r.randrange(-5, 1 << 20),
                lambda: [self.value(depth + 1) for _ in range(r.randrange(4))],
                lambda: {self.word(): self.value(depth + 1) for _ in range(r.randrange(4))},
                ][r.randrange(9 if depth < 2 else 7)]()

    def word(self) -> str:
        return self.rng.choice(["kind", "start", "end", "session_ids", "positions", "optim", "run_id", "x", ""])

    def metadata(self) -> bytes:
        r = self.rng
        kind = r.choice(sorted(INFERENCE_KINDS))
        fields = [n for n, _, _ in INFERENCE_KINDS[kind]._schema()]
        how = r.randrange(6)
        if how == 0:
            return r.randbytes(r.randrange(64))
        if how == 1:
            return msgpack.packb({"kind": self.value(), "session_ids": [], "positions": []})
        if how == 2:  # a known kind with fields of any type (huge ints, bytes for str, nested lists...)
            return msgpack.packb({"kind": kind, **{f: self.value() for f in fields if r.random() < 0.8}})
        if how == 3:  # values 1000 levels deep, spliced in (msgpack cannot write them)
            return b"\x82" + msgpack.packb("kind") + msgpack.packb(r.choice(["step", "train_open", "hello"])) \
                + msgpack.packb(r.choice(["session_ids", "optim", "proof"])) + r.choice(DEEP)
        if how == 4:  # too much metadata
            return msgpack.packb({"kind": "forward", "start": 0, "end": 8, "pad": r.randbytes(70_000)})
        return msgpack.packb(self.value())  # not a map

    def tensor(self, channel) -> list[bytes]:
        """A forward (or step, or training call) whose tensor is wrong in one way."""
        r = self.rng
        metadata = r.choice([pack_inference(INFERENCE_KINDS["forward"](start=0, end=8)),
                             msgpack.packb({"kind": "step", "session_ids": ["s"], "positions": [0]}),
                             msgpack.packb({"kind": "train_forward", "run_id": "r", "micro_id": "m"})])
        how = r.randrange(7)
        good = torch.randn(1, r.randrange(1, 6), HIDDEN)
        seal = (lambda data, aad: channel.seal(data, step=0, aad=aad)) if channel and r.random() < 0.7 else None
        if how == 0:  # a tensor of the wrong dtype, shape or values
            bad = r.choice([good.double(), good[..., :7], good.reshape(-1), torch.full_like(good, float("nan")),
                            torch.ones(1, 3, HIDDEN, dtype=torch.int64), torch.randn(9, 2, HIDDEN)])
            return [encode(m) for m in tensor_messages(bad, metadata, seal=seal)]
        part = serialize(good)
        if seal is not None:
            part.buffer = seal(part.buffer, metadata)
        if how == 1:
            part.buffer = part.buffer[:r.randrange(len(part.buffer))]  # size mismatch (or a broken seal)
        elif how == 2:
            part.compression = r.choice([1, 2, 3, 4, 5, 77])
        elif how == 3:
            del part.size[:]
            part.size.extend(r.choice([[1 << 31] * 3, [1] * 20, [0, 1 << 31, 1 << 31], [2, 3]]))
        elif how == 4:
            part.dtype = r.choice(["float64", "int8", "", "x" * 500, "bool"])
        elif how == 5:
            part.requires_grad = True
        else:
            part.buffer = r.randbytes(len(part.buffer))  # garbage in place of the sealed bytes
        return [encode(runtime_pb2.ExpertRequest(tensors=[part], metadata=metadata))]

    def chunks(self) -> list[bytes]:
        """Chunk counts that lie: more declared than sent, fewer, or chunk messages with 0 or 2 tensors."""
        r = self.rng
        part = serialize(torch.randn(1, 2, HIDDEN))
        part.chunks = r.choice([2, 5, 100, -3, 0])
        first = runtime_pb2.ExpertRequest(tensors=[part], metadata=pack_inference(INFERENCE_KINDS["forward"](0, 8)))
        extra = runtime_pb2.ExpertRequest(tensors=[runtime_pb2.Tensor(buffer=r.randbytes(16))] * r.choice([0, 1, 2]))
        return [encode(first)] + [encode(extra)] * r.randrange(4)

    def breaking(self) -> list[bytes]:
        """Frames after which the peer must close the stream (the framing cannot be resynced)."""
        r = self.rng
        how = r.randrange(5)
        if how == 0:
            return [r.randbytes(r.randrange(1, 200))]  # raw bytes, unframed
        if how == 1:
            return [bytes([r.randrange(2, 256)]) + r.randbytes(20)]  # unknown marker
        if how == 2:
            return [b"\x00" + (64).to_bytes(8, "big") + r.randbytes(64)]  # an undecodable protobuf, maybe
        if how == 3:
            return [b"\x00" + (100).to_bytes(8, "big") + r.randbytes(10)]  # truncated: the stream ends inside it
        return [b"\x00" + (MAX_FRAME + 1 + r.randrange(1 << 20)).to_bytes(8, "big")]  # just above the cap


class Tally:
    def __init__(self) -> None:
        self.sent = self.replies = self.refused = self.internal = self.closed_by_peer = self.stuck = 0
        self.oversized_closed: bool | None = None  # did the peer close the stream of the 2^40-byte frame?


class Replies:
    """Reads and counts one stream's replies in a task until the stream ends."""

    def __init__(self, reader: asyncio.StreamReader, tally: Tally) -> None:
        self.tally, self.last = tally, time.monotonic()  # last: when a reply (not a heartbeat) came
        self.task = asyncio.create_task(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> bool:
        """Whether the peer closed the stream with an error frame (it broke the framing)."""
        try:
            while (frame := await read_frame(reader, MAX_FRAME)) is not None:
                marker, payload = frame
                if marker == ERROR:
                    self.tally.closed_by_peer += 1
                    return True
                reply = InferenceReply.from_bytes(runtime_pb2.ExpertResponse.FromString(payload).metadata)
                if reply.alive:
                    continue
                self.last = time.monotonic()
                errors = [reply.error, *reply.errors]
                self.tally.replies += 1
                self.tally.refused += any(errors)
                self.tally.internal += any(e.startswith("internal error") for e in errors)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        return False

    async def finish(self, idle: float = 2.0, limit: float = 30.0) -> bool | None:
        """Wait for the end of the stream; None if it stays open with no reply for ``idle`` s (a frame cut short
        keeps the peer waiting for the rest) or past ``limit`` s."""
        started = self.last = max(self.last, time.monotonic())
        while not self.task.done():
            await asyncio.wait({self.task}, timeout=0.2)
            now = time.monotonic()
            if not self.task.done() and (now - self.last > idle or now - started > limit):
                self.task.cancel()
                return None
        return self.task.result()


async def fuzz_stream(p2p, peer_id: str, fuzzer: Fuzzer, count: int, tally: Tally, ending: str = "clean") -> None:
    """One stream: maybe a hello (encrypted or not), ``count`` fuzzed requests, then the end of stream, or (ending
    "breaking") one more frame that breaks the framing, or ("oversized") a frame that declares 2^40 bytes."""
    oversized = ending == "oversized"
    r = fuzzer.rng
    _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), INFERENCE_HANDLE)
    channel = None
    try:
        if r.random() < 0.9:
            handshake = ClientHandshake(public_key_of(peer_id), new_session_id()) if r.random() < 0.8 else None
            hello = InferenceHello(hello=handshake.hello() if handshake else b"")
            writer.write(encode(runtime_pb2.ExpertRequest(metadata=pack_inference(hello))))
            frame = await asyncio.wait_for(read_frame(reader, MAX_FRAME), 10)
            if frame is None or frame[0] == ERROR:
                raise ConnectionError("the peer closed the stream instead of answering the hello")
            reply = InferenceReply.from_bytes(runtime_pb2.ExpertResponse.FromString(frame[1]).metadata)
            channel = handshake.finish(reply.handshake) if handshake and not reply.error else None
        replies = Replies(reader, tally)
        frames = []
        for _ in range(count):
            frames += r.choice([lambda: [encode(runtime_pb2.ExpertRequest(metadata=fuzzer.metadata()))],
                                lambda: fuzzer.tensor(channel), fuzzer.chunks])()
        tally.sent += len(frames)  # every frame counts: a lying chunk count's extra chunks too
        if oversized:  # declares 2^40 bytes, then sends some MiB: the peer must close at the header
            frames.append(b"\x00" + (1 << 40).to_bytes(8, "big") + bytes(8 << 20))
            tally.sent += 1
        elif ending == "breaking":
            frames += fuzzer.breaking()
            tally.sent += 1
        else:
            frames.append(end_of_stream())
        closed = False
        try:
            await asyncio.wait_for(_write(writer, frames), 30)
        except (ConnectionError, OSError):
            closed = True  # the peer closed the stream while we wrote (after a breaking frame): expected
            tally.closed_by_peer += 1
        ended = await replies.finish()
        closed = bool(ended) or closed
        tally.stuck += ended is None and ending == "clean"  # after our end of stream the peer must end it too
        if oversized:
            tally.oversized_closed = closed
    except (ConnectionError, OSError, asyncio.IncompleteReadError, asyncio.TimeoutError):
        tally.closed_by_peer += 1
    finally:
        writer.close()


async def _write(writer: asyncio.StreamWriter, frames: list[bytes]) -> None:
    for frame in frames:
        for offset in range(0, len(frame), 1 << 20):
            writer.write(frame[offset:offset + (1 << 20)])
            await writer.drain()


async def check_forward(p2p, peer_id: str, blocks, stream: PeerStream | None) -> bool:
    """A well-behaved client's forward through the peer equals the local forward of the same blocks."""
    hidden = torch.randn(2, 7, HIDDEN)
    with torch.no_grad():
        expected, _ = blocks(hidden, torch.arange(7).expand(2, 7))
    fresh = stream is None
    stream = stream or await PeerStream.connect(p2p, peer_id, timeout=20)
    try:
        got = await stream.forward(*SPAN, hidden, timeout=30)
    except Exception as e:  # a refusal or a broken stream: the peer stopped serving
        print(f"check failed: {e!r}", flush=True)
        return False
    finally:
        if fresh:
            stream.shutdown()
    return bool((got - expected).abs().max().item() < 1e-4)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def hold_partial_frames(p2p, peer_id: str, pid: int, count: int) -> dict:
    """``count`` streams that each send all but the last byte of a frame of the largest size allowed, then wait:
    the peer's RSS while they are held, and 3 s after they close."""
    writers, refused = [], 0
    for _ in range(count):
        _, _, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), INFERENCE_HANDLE)
        writers.append(writer)
        try:
            await _write(writer, [b"\x00" + MAX_FRAME.to_bytes(8, "big") + bytes(MAX_FRAME - 1)])
        except (ConnectionError, OSError):
            refused += 1  # the peer closed it (e.g. a deadline on frames): what a fix would do
    await asyncio.sleep(3)
    held = rss_mib(pid)
    for writer in writers:
        writer.close()
    await asyncio.sleep(3)
    return dict(partial_frames=count, partial_frames_closed_by_peer=refused, rss_partial_frames_held_mib=round(held, 1),
                rss_partial_frames_closed_mib=round(rss_mib(pid), 1))


async def fuzz(swarm: LocalSwarm, proc, model_dir: Path, *, messages: int, batch: int, streams: int,
               seed: int, partial_frames: int) -> dict:
    node = await start_node(initial_peers=swarm.initial_peers, client_mode=True)
    try:
        for _ in range(100):
            if [r for r in await fetch_records(node, model_dir.name) if r.peer_id == proc.peer_id]:
                break
            await asyncio.sleep(0.2)
        peer_id, p2p = proc.peer_id, node.p2p
        blocks = load_blocks(model_dir, *SPAN, dtype=torch.float32).eval()
        fuzzer, tally, checks, passed = Fuzzer(seed), Tally(), 0, 0
        long_lived = await PeerStream.connect(p2p, peer_id, timeout=20)
        rss = [rss_mib(proc.pid)]
        started, oversized_done = time.monotonic(), False
        while tally.sent < messages:
            goal = min(messages, tally.sent + batch)
            while tally.sent < goal:
                jobs, planned = [], tally.sent
                while len(jobs) < streams and planned < goal:
                    count = max(1, min(fuzzer.rng.randrange(1, 40), goal - planned - 1))
                    big = not oversized_done and planned >= messages // 2
                    ending = "oversized" if big else "breaking" if fuzzer.rng.random() < 0.3 else "clean"
                    oversized_done, planned = oversized_done or big, planned + count + (ending != "clean")
                    jobs.append(fuzz_stream(p2p, peer_id, Fuzzer(fuzzer.rng.randrange(1 << 30)), count, tally,
                                            ending))
                await asyncio.gather(*jobs)
                rss.append(rss_mib(proc.pid))
            results = [await check_forward(p2p, peer_id, blocks, long_lived),
                       await check_forward(p2p, peer_id, blocks, None)]
            checks, passed = checks + len(results), passed + sum(results)
            rss.append(rss_mib(proc.pid))
            print(f"sent {tally.sent}, refused {tally.refused}, checks {passed}/{checks}, rss {rss[-1]:.0f} MiB",
                  flush=True)
        long_lived.shutdown()
        partial = await hold_partial_frames(p2p, peer_id, proc.pid, partial_frames)
        log = proc.log()
        return dict(messages_sent=tally.sent, replies=tally.replies, refused=tally.refused,
                    internal_errors=tally.internal, streams_closed_by_peer=tally.closed_by_peer,
                    stuck_streams=tally.stuck, oversized_frame_closed=tally.oversized_closed, checks=checks,
                    correct_after=passed,
                    rss_start_mib=round(rss[0], 1), rss_max_mib=round(max(rss), 1), rss_end_mib=round(rss[-1], 1),
                    tracebacks_in_log=log.count("Traceback (most recent call last)"),
                    seconds=round(time.monotonic() - started, 1), peer_alive=proc.popen.poll() is None, **partial)
    finally:
        await node.shutdown()


def run(workdir: Path, *, messages: int = 10_000, batch: int = 1000, streams: int = 8, seed: int = 0,
        partial_frames: int = 16) -> dict:
    """Start the swarm in ``workdir``, fuzz its peer, stop everything; the JSON summary."""
    model_dir = make_tiny_model(workdir / "llama-fuzz", seed=1, **MODEL)
    with LocalSwarm(workdir, update_period=5.0) as swarm:
        swarm.start_dht()
        proc = swarm.start_peer(model_dir, block_indices=f"{SPAN[0]}:{SPAN[1]}")
        return asyncio.run(fuzz(swarm, proc, model_dir, messages=messages, batch=batch, streams=streams, seed=seed,
                                partial_frames=partial_frames))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=1000, help="messages between two correctness checks")
    parser.add_argument("--streams", type=int, default=8, help="fuzzed streams at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--partial_frames", type=int, default=16,
                        help="at the end, streams that each hold an unfinished frame (the peer's RSS is sampled)")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fusionswarm-fuzz-"))
    print(json.dumps(run(workdir, messages=args.messages, batch=args.batch, streams=args.streams, seed=args.seed,
                         partial_frames=args.partial_frames)))


if __name__ == "__main__":
    main()
