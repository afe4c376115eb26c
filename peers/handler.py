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

from peers.backend import StageBackend
from peers.inference_rpc import InferenceRPC
from peers.protocol import (
    ForwardReply,
    ForwardRequest,
    RequestError,
    StageInfo,
    StageService,
    read_tensor_messages,
    tensor_messages,
)
from peers.sessions import SessionRegistry
from privacy.identity import Identity

logger = logging.getLogger(__name__)


class StageHandler(StageService):
    """Serves one ``StageBackend`` over hivemind P2P. Bad requests get a reply that says what is wrong."""

    def __init__(
        self, backend: StageBackend, info: StageInfo, sessions: SessionRegistry, *, request_timeout: float,
        identity: Identity, require_encryption: bool = True,
    ) -> None:
        self.backend, self.info, self.sessions, self.request_timeout = backend, info, sessions, request_timeout
        self.inference = InferenceRPC(backend, info, sessions, request_timeout=request_timeout,
                                      check_hidden=self._check_hidden, identity=identity,
                                      require_encryption=require_encryption)

    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        info = dataclasses.replace(
            self.info, cache_tokens_free=self.sessions.tokens_free, sessions=len(self.sessions.sessions),
            inference_steps=self.backend.inference_steps, inference_batches=self.backend.inference_batches,
        )
        return runtime_pb2.ExpertInfo(serialized_info=info.to_bytes())

    async def rpc_inference(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for response in self.inference.serve(requests, context):
            yield response

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

    def _check_hidden(self, hidden: torch.Tensor, max_rows: int | None = None) -> None:
        info, max_rows = self.info, max_rows or self.info.max_batch_size
        if hidden.ndim != 3 or hidden.shape[-1] != info.hidden_size:
            raise RequestError(f"hidden states must be [batch, seq, {info.hidden_size}], got {list(hidden.shape)}")
        if not 1 <= hidden.shape[0] <= max_rows:
            raise RequestError(f"batch of {hidden.shape[0]} is above this peer's limit of {max_rows}")
        if not 1 <= hidden.shape[1] <= info.max_seq_len:
            raise RequestError(f"sequence of {hidden.shape[1]} tokens; this model takes 1..{info.max_seq_len}")
        if not torch.isfinite(hidden).all():
            raise RequestError("hidden states contain NaN or infinite values")


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
