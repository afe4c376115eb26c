"""What every request handler of a peer's stream shares: the stream's state, the request being handled (``Call``),
reading the tensor a request carries, and replies."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.proto import runtime_pb2

from peers.core.aio import deadline
from peers.server.kv_sessions import Session
from peers.wire.errors import RequestError
from peers.wire.framing import IncomingFrames
from peers.wire.messages import InferenceReply, StageInfo
from peers.wire.tensors import read_coded_messages, read_tensor_messages, sealer, tensor_messages, unsealer
from privacy.certificates import Certificate
from privacy.channel import SecureChannel
from swarm.compression import NONE, Codec, Encoded

Responses = list[runtime_pb2.ExpertResponse]


@dataclass(eq=False)
class StreamState:
    """One stream: admitted or not, its encrypted channel once a hello set it up, and whether it is at work."""

    admitted: bool
    hello_seen: bool = False
    member: Certificate | None = None  # what admission returned for the stream's hello
    channel: SecureChannel | None = None
    heartbeat: asyncio.Event = field(default_factory=asyncio.Event)  # set once the client's hello asked for them
    busy: bool = False  # a request is being handled
    deferred: int = 0  # replies of deferred requests not written yet (``Deferred``)
    owned: dict[str, Session] = field(default_factory=dict)  # the inference sessions opened on this stream

    @property
    def seal(self) -> Callable[[bytes, bytes], bytes] | None:
        return sealer(self.channel)

    @property
    def unseal(self) -> Callable[[bytes, bytes], bytes] | None:
        return unsealer(self.channel)


@dataclass(eq=False)
class Call:
    """The request being handled: its first message, the rest of the stream, the caller and the stream's state."""

    message: runtime_pb2.ExpertRequest
    requests: IncomingFrames
    caller: str  # the caller's peer id
    stream: StreamState
    kind: str = "unknown"  # the request's message type, once parsed (``peers.server.metrics``)


@dataclass(eq=False)
class Deferred:
    """A reply that comes later (a chained request waiting for its input from another peer): the stream goes on
    reading and handling its next requests meanwhile; replies are still written in request order."""

    task: asyncio.Task


def defer(work: Awaitable[Responses], what: str) -> Deferred:
    """Run ``work`` concurrently with the stream's next requests; a refusal or a bug becomes an error reply."""

    async def guarded() -> Responses:
        try:
            return await work
        except (RequestError, ValueError, asyncio.TimeoutError) as e:
            return [reply(error=str(e) or f"{what} exceeded its deadline")]
        except Exception as e:  # a bug must cost one request, not the stream and its sessions
            logging.getLogger(__name__).warning("A deferred %s failed: %r", what, e)
            return [reply(error=f"internal error: {type(e).__name__}: {e}")]

    return Deferred(asyncio.ensure_future(guarded()))


Handler = Callable[[Any, Call], Awaitable["Responses | Deferred"]]  # takes the request kind it is registered for


def elapsed_ms(started: float) -> float:
    """Milliseconds since ``started`` (``time.perf_counter()``): a reply's ``compute_ms``, this peer's own time on a
    request (from its tensor read to its reply built), which callers subtract from their wall time to measure the
    network (``swarm.links``). Never 0, which means "not reported"."""
    return max(1e-3, 1e3 * (time.perf_counter() - started))


def reply(*, error: str = "", length: int = 0) -> runtime_pb2.ExpertResponse:
    return runtime_pb2.ExpertResponse(metadata=InferenceReply(error=error, length=length).to_bytes())


def tensor_reply(tensor: torch.Tensor | Encoded, metadata: InferenceReply, stream: StreamState, codec: Codec = NONE,
                 indices: torch.Tensor | None = None) -> Responses:
    """A reply carrying ``tensor`` in ``codec`` (``indices``: top-k's forced pattern), sealed on an encrypted
    stream, in chunk messages."""
    return list(tensor_messages(tensor, metadata.to_bytes(), runtime_pb2.ExpertResponse, seal=stream.seal,
                                codec=codec, indices=indices))


def codec_of(texts: list[str]) -> Codec:
    """The codec the clients of these sessions (or this forward) asked for (``compression`` texts, checked at open);
    ``none`` unless they all agree."""
    named = {text or "none" for text in texts}
    return Codec.parse(named.pop()) if len(named) == 1 else NONE


class StreamCalls:
    """Reading and skipping the tensors of requests, within the peer's limits."""

    def __init__(self, info: StageInfo, *, request_timeout: float, require_encryption: bool) -> None:
        self.info, self.request_timeout, self.require_encryption = info, request_timeout, require_encryption

    async def read_tensor(self, call: Call) -> torch.Tensor:
        """The tensor a request carries; refused (and skipped) on a plaintext stream when encryption is required."""
        tensor, _ = await self.read_coded(call)
        return tensor

    async def read_coded(self, call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tensor a request carries, in any codec, and (top-k) the sorted flat indices it kept, else None.
        Within ``max_request_bytes`` on the wire and decoded; refused (and skipped) on a plaintext stream when
        encryption is required."""
        if call.stream.channel is None and self.require_encryption:
            await self.skip_tensor(call)
            raise RequestError("this peer only takes encrypted streams: send a hello (handshake) first")
        if not call.message.tensors:
            raise RequestError("this request must carry a tensor")
        async with deadline(self.request_timeout):
            _, tensor, indices = await read_coded_messages(call.requests, self.info.max_request_bytes,
                                                           first=call.message, unseal=call.stream.unseal)
        return tensor, indices

    async def skip_tensor(self, call: Call) -> None:
        """Consume the rest of a refused message's tensor, so that the stream stays in step."""
        if call.message.tensors:
            try:
                async with deadline(self.request_timeout):
                    await read_tensor_messages(call.requests, self.info.max_request_bytes, first=call.message)
            except (RequestError, ValueError, asyncio.TimeoutError):
                pass
