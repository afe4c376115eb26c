"""``StageHandler``: each RPC parses, validates, computes and serializes; nothing else."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import AsyncIterator  # noqa: UP035  (typing's: hivemind's servicer reads it)

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from peers.aio import deadline
from peers.backend import StageBackend
from peers.protocol import (
    ForwardReply,
    ForwardRequest,
    InferenceOpen,
    InferenceReply,
    InferenceStep,
    RequestError,
    StageInfo,
    StageService,
    read_tensor_messages,
    tensor_messages,
)
from peers.sessions import Session, SessionRegistry

logger = logging.getLogger(__name__)


class StageHandler(StageService):
    """Serves one ``StageBackend`` over hivemind P2P. Bad requests get a reply that says what is wrong."""

    def __init__(
        self, backend: StageBackend, info: StageInfo, sessions: SessionRegistry, *, request_timeout: float
    ) -> None:
        self.backend, self.info, self.sessions, self.request_timeout = backend, info, sessions, request_timeout

    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        info = dataclasses.replace(
            self.info, cache_tokens_free=self.sessions.tokens_free, sessions=len(self.sessions.sessions),
            inference_steps=self.backend.inference_steps, inference_batches=self.backend.inference_batches,
        )
        return runtime_pb2.ExpertInfo(serialized_info=info.to_bytes())

    async def rpc_inference(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        try:
            first = await asyncio.wait_for(anext(requests), timeout=self.request_timeout)
            session = self.sessions.open(InferenceOpen.from_bytes(first.metadata), str(context.remote_id),
                                         (self.info.start, self.info.end))
        except (RequestError, ValueError) as e:
            logger.info("rpc_inference(peer=...%s) refused: %s", _short(context), e)
            yield _inference_reply(error=str(e))
            return
        except (StopAsyncIteration, asyncio.TimeoutError):
            return
        logger.debug("Session %s opened for blocks %d:%d", session.session_id, session.start, session.end)
        yield _inference_reply(length=session.length)
        closed = False
        try:
            while not closed:
                try:
                    async with deadline(self.sessions.timeout):
                        message = await anext(requests)
                except StopAsyncIteration:  # stream broken without a close: keep the cache for a resume
                    break
                except asyncio.TimeoutError:
                    closed = True
                    yield _inference_reply(error=f"session idle for {self.sessions.timeout:.0f} s; its cache is freed")
                    break
                try:
                    step = InferenceStep.from_bytes(message.metadata)
                    if step.close:
                        closed = True
                        break
                    async with deadline(self.request_timeout):
                        output = await self._inference_step(session, step, requests, message)
                except (RequestError, ValueError, asyncio.TimeoutError) as e:
                    error = str(e) or f"step exceeded the deadline of {self.request_timeout:.0f} s"
                    logger.info("rpc_inference(session=%s) step refused: %s", session.session_id, error)
                    yield _inference_reply(error=error, length=session.length)
                    continue
                reply = InferenceReply(length=session.length).to_bytes()
                for chunk in tensor_messages(output, reply, runtime_pb2.ExpertResponse):
                    yield chunk
        finally:
            if closed:
                self.sessions.close(session.session_id)
            else:
                self.sessions.detach(session.session_id)

    async def _inference_step(
        self, session: Session, step: InferenceStep, requests: AsyncIterator, message: runtime_pb2.ExpertRequest
    ) -> torch.Tensor:
        _, hidden = await read_tensor_messages(requests, self.info.max_request_bytes, first=message)
        self._check_hidden(hidden)
        if hidden.shape[0] != session.batch_size:
            raise RequestError(f"this session has batch size {session.batch_size}, got {hidden.shape[0]} rows")
        if not 0 <= step.position <= session.length:
            raise RequestError(f"step starts at token {step.position} but the session holds {session.length}")
        if step.position + hidden.shape[1] > session.max_length:
            raise RequestError(
                f"step would reach {step.position + hidden.shape[1]} tokens, beyond the session's max_length "
                f"{session.max_length}; open a session with a larger max_length"
            )
        session.last_used = time.monotonic()
        return await self.backend.inference_step(session, hidden, step.position)

    async def rpc_forward(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        t0, blocks = time.perf_counter(), "?"
        try:
            output, blocks = await asyncio.wait_for(self._forward(requests), timeout=self.request_timeout)
        except (RequestError, ValueError) as e:
            logger.info("rpc_forward(blocks=%s, peer=...%s) refused: %s", blocks, _short(context), e)
            await _drain(requests)
            yield runtime_pb2.ExpertResponse(metadata=ForwardReply(error=str(e)).to_bytes())
            return
        except asyncio.TimeoutError:
            message = f"deadline of {self.request_timeout:.1f} s exceeded on this peer; retry or use another peer"
            logger.info("rpc_forward(peer=...%s) timed out", _short(context))
            await _drain(requests)
            yield runtime_pb2.ExpertResponse(metadata=ForwardReply(error=message).to_bytes())
            return
        await _drain(requests)
        elapsed_ms = 1e3 * (time.perf_counter() - t0)
        logger.debug("rpc_forward(blocks=%s, peer=...%s) %.1f ms", blocks, _short(context), elapsed_ms)
        for message in tensor_messages(output, ForwardReply().to_bytes(), runtime_pb2.ExpertResponse):
            yield message

    async def _forward(self, requests: AsyncIterator[runtime_pb2.ExpertRequest]) -> tuple[torch.Tensor, str]:
        metadata, hidden = await read_tensor_messages(requests, self.info.max_request_bytes)
        request = ForwardRequest.from_bytes(metadata)
        self._check_blocks(request.start, request.end)
        self._check_hidden(hidden)
        return await self.backend.forward(hidden, request.start, request.end), f"{request.start}:{request.end}"

    def _check_blocks(self, start: int, end: int) -> None:
        if not self.info.start <= start < end <= self.info.end:
            raise RequestError(
                f"this peer serves blocks {self.info.start}:{self.info.end}, not {start}:{end}; "
                f"refresh your view of the swarm and route that span elsewhere"
            )

    def _check_hidden(self, hidden: torch.Tensor) -> None:
        info = self.info
        if hidden.ndim != 3 or hidden.shape[-1] != info.hidden_size:
            raise RequestError(f"hidden states must be [batch, seq, {info.hidden_size}], got {list(hidden.shape)}")
        if not 1 <= hidden.shape[0] <= info.max_batch_size:
            raise RequestError(f"batch of {hidden.shape[0]} is above this peer's limit of {info.max_batch_size}")
        if not 1 <= hidden.shape[1] <= info.max_seq_len:
            raise RequestError(f"sequence of {hidden.shape[1]} tokens; this model takes 1..{info.max_seq_len}")
        if not torch.isfinite(hidden).all():
            raise RequestError("hidden states contain NaN or infinite values")


def _inference_reply(*, error: str = "", length: int = 0) -> runtime_pb2.ExpertResponse:
    return runtime_pb2.ExpertResponse(metadata=InferenceReply(error=error, length=length).to_bytes())


async def _drain(requests: AsyncIterator, timeout: float = 5.0) -> None:
    """Read what is left of a request stream (up to its end marker) before replying.

    Closing a stream while the caller still writes makes the caller's socket fail, and asyncio then drops
    the reply that was already buffered for it; so a handler lets the caller finish first.
    """
    async def consume() -> None:
        async for _ in requests:
            pass

    try:
        await asyncio.wait_for(consume(), timeout)
    except (asyncio.TimeoutError, Exception) as e:
        logger.debug("Could not drain a request stream: %s", e)


def _short(context: P2PContext) -> str:
    return str(context.remote_id)[-6:]
