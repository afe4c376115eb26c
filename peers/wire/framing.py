"""Frames of one P2P stream, read with a size cap before anything is buffered.

The format is hivemind's, so that any hivemind stream client or server talks to ours: a marker byte
(``MESSAGE`` or ``ERROR``), an 8-byte big-endian length and that many bytes of protobuf. hivemind's own
reader trusts the declared length and buffers the whole frame first (a frame that declares 2^40 bytes
makes the reader hold everything the sender sends); ``read_frame`` refuses a frame whose declared length
exceeds its cap as soon as the header arrives.

``IncomingFrames`` reads a stream in a task of its own into a bounded queue, so that a consumer can wait
for the next message with a deadline (cancelling ``queue.get`` loses nothing; cancelling hivemind's request
iterator ends it). ``FrameWriter`` writes whole frames, one ``write`` each, so frames from several tasks
(replies and heartbeats) never interleave.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from google.protobuf.message import DecodeError, Message
from hivemind.proto.p2pd_pb2 import RPCError

from peers.core.aio import deadline
from peers.wire import activity, traffic

logger = logging.getLogger(__name__)

MESSAGE, ERROR = b"\x00", b"\x01"
HEADER_BYTES = 8
MAX_FRAME_BYTES = (1 << 20) + (256 << 10)  # our chunks: 1 MiB of tensor plus at most 64 KiB of metadata
BODY_GRACE, BODY_MIN_RATE = 10.0, 32 << 10  # a frame's body must arrive within 10 s + its size at 32 KiB/s
PIECE_BYTES = 64 << 10  # a long frame's body is read in pieces of this size, each a sign of life of the sender

P = TypeVar("P", bound=Message)


class FrameError(ValueError):
    """The stream broke the framing (unknown marker, oversized or undecodable frame); it cannot be resynced."""


async def read_frame(reader: asyncio.StreamReader, max_bytes: int = MAX_FRAME_BYTES,
                     progress: Callable[[], None] | None = None) -> tuple[bytes, bytes] | None:
    """The next ``(marker, payload)``, or None at a clean end of stream (EOF between frames).

    Raises ``FrameError`` for an unknown marker, a declared length above ``max_bytes`` (before reading the
    payload) or a body slower than ``BODY_MIN_RATE`` after ``BODY_GRACE`` seconds (so that a sender cannot pin an
    unfinished frame's memory for long), and ``asyncio.IncompleteReadError`` if the stream ends inside a frame.
    ``progress`` is called as parts of the body arrive (every ``PIECE_BYTES``): the sender is alive.
    """
    marker = await reader.read(1)
    if not marker:
        return None
    if marker not in (MESSAGE, ERROR):
        raise FrameError(f"unknown frame marker {marker!r}")
    length = int.from_bytes(await reader.readexactly(HEADER_BYTES), "big")
    if length > max_bytes:
        raise FrameError(f"a frame of {length} bytes exceeds the limit of {max_bytes} bytes")
    seconds = BODY_GRACE + length / BODY_MIN_RATE
    try:
        async with deadline(seconds):
            if progress is None or length <= PIECE_BYTES:
                return marker, await reader.readexactly(length)
            pieces = []
            for offset in range(0, length, PIECE_BYTES):
                pieces.append(await reader.readexactly(min(PIECE_BYTES, length - offset)))
                progress()
            return marker, b"".join(pieces)
    except asyncio.TimeoutError:
        raise FrameError(f"a frame of {length} bytes did not arrive within {seconds:.0f} s") from None


def parse(cls: type[P], payload: bytes) -> P:
    """A protobuf message from a frame's payload; ``FrameError`` if it does not decode."""
    message = cls()
    try:
        message.ParseFromString(payload)
    except (DecodeError, RuntimeWarning, ValueError) as e:
        raise FrameError(f"undecodable {cls.__name__}: {e}") from None
    return message


def encode(message: Message, marker: bytes = MESSAGE) -> bytes:
    data = message.SerializeToString()
    return marker + len(data).to_bytes(HEADER_BYTES, "big") + data


class FrameWriter:
    """Writes whole frames to a stream; ``drain`` is serialised so that concurrent writers wait their turn."""

    def __init__(self, writer: asyncio.StreamWriter, peer: str = "") -> None:
        self.writer, self.peer = writer, peer  # ``peer``: whom the bytes go to (``peers.wire.traffic``)
        self._lock = asyncio.Lock()
        self.last_write = 0.0  # loop time of the last frame written

    async def send(self, *frames: bytes) -> None:
        """Write ``frames`` back to back (nothing else comes between them), then wait for the buffer to drain."""
        data = b"".join(frames)
        self.writer.write(data)
        traffic.counted("out", self.peer, len(data))
        self.last_write = asyncio.get_running_loop().time()
        async with self._lock:
            await self.writer.drain()

    def close(self) -> None:
        if not self.writer.is_closing():
            self.writer.close()


@dataclass(frozen=True)
class StreamEnd:
    """What ended an ``IncomingFrames``: ``error`` is empty for a clean end (EOF or the sender's end marker);
    ``broken_framing``: our side refused the bytes (the sender should be told why)."""

    error: str = ""
    broken_framing: bool = False


_END = object()


class IncomingFrames(Generic[P]):
    """Messages of type ``cls`` read from ``reader`` by a background task, at most ``max_queued`` ahead.

    Iterate it (``async for`` / ``anext``) or call ``get()``; both are safe to cancel. After the stream ends,
    ``end`` says how: a clean end, an error frame from the other side, or a framing error on ours.
    """

    def __init__(self, reader: asyncio.StreamReader, cls: type[P], *, max_queued: int = 8,
                 max_frame_bytes: int = MAX_FRAME_BYTES, name: str = "stream", peer: str = "") -> None:
        self.cls, self.name, self.max_frame_bytes, self.peer = cls, name, max_frame_bytes, peer
        self.end: StreamEnd | None = None
        self.last_frame = 0.0  # loop time the last frame (or a piece of a long one) arrived
        self._queue: asyncio.Queue = asyncio.Queue(max_queued)
        self._task = asyncio.create_task(self._pump(reader))

    @property
    def queued(self) -> int:
        """Messages read but not consumed yet."""
        return self._queue.qsize()

    async def get(self) -> P | None:
        """The next message, or None once the stream has ended (see ``end``)."""
        item = await self._queue.get()
        if item is _END:
            self._queue.put_nowait(_END)  # every later call sees the end too
            return None
        return item

    def __aiter__(self) -> IncomingFrames[P]:
        return self

    async def __anext__(self) -> P:
        item = await self.get()
        if item is None:
            raise StopAsyncIteration
        return item

    def close(self) -> None:
        self._task.cancel()

    def _alive(self) -> None:
        self.last_frame = asyncio.get_running_loop().time()
        activity.heard(self.peer, self.last_frame)

    async def _pump(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                frame = await read_frame(reader, self.max_frame_bytes, self._alive)
                if frame is None:
                    self.end = StreamEnd()
                    break
                marker, payload = frame
                self._alive()
                traffic.counted("in", self.peer, HEADER_BYTES + 1 + len(payload))
                if marker == ERROR:  # hivemind's end-of-stream is an empty error; anything else is the peer's error
                    self.end = StreamEnd(parse_error(payload))
                    break
                await self._queue.put(parse(self.cls, payload))
        except asyncio.IncompleteReadError:
            self.end = StreamEnd(f"{self.name} ended inside a frame")
        except FrameError as e:
            self.end = StreamEnd(f"{self.name} broke the framing: {e}", broken_framing=True)
        except (ConnectionError, OSError) as e:
            self.end = StreamEnd(f"{self.name} broke: {e!r}")
        except asyncio.CancelledError:
            self.end = self.end or StreamEnd(f"{self.name} was closed")
            while self._queue.full():  # closed: the consumer is gone or must see the end at once
                self._queue.get_nowait()
            self._queue.put_nowait(_END)
            raise
        await self._queue.put(_END)  # after every message already read


def parse_error(payload: bytes) -> str:
    """The message of hivemind's ``RPCError`` frame (empty: the sender's end of stream)."""
    try:
        return parse(RPCError, payload).message
    except FrameError:
        return "undecodable error frame"


def end_of_stream() -> bytes:
    """hivemind's end-of-stream frame: an empty ``RPCError``."""
    return encode(RPCError(), ERROR)
