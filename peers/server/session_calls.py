"""The inference-session requests of a peer's stream: open, steps of one or more sessions, close.

Steps of several sessions in one message are validated part by part; a refused part leaves its session as it was
and does not affect the others. An open waits for cache space only on a stream with no live session (replies are
in order, so a waiting open would hold up the steps of that stream's other sessions).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import torch
from hivemind.proto import runtime_pb2

from peers.core.aio import deadline
from peers.model.adapters import Active
from peers.server.backend import StageBackend
from peers.server.calls import Call, Deferred, Responses, StreamCalls, codec_of, elapsed_ms, reply, tensor_reply
from peers.server.chain_calls import ChainCalls, check_step
from peers.server.kv_sessions import Session, SessionRegistry
from peers.wire.errors import MovedError, RequestError
from peers.wire.messages import InferenceClose, InferenceOpen, InferenceReply, InferenceStep, StageInfo
from privacy.peer_ids import short_id
from swarm.compression import Codec

logger = logging.getLogger(__name__)


class SessionCalls(StreamCalls):
    """Opens, steps and closes the sessions of a stream on ``backend`` within ``sessions``' cache budget."""

    def __init__(self, backend: StageBackend, sessions: SessionRegistry, info: StageInfo, *,
                 check_hidden: Callable[..., None], request_timeout: float, require_encryption: bool,
                 chain: ChainCalls, check_blocks: Callable[[int, int], None] | None = None,
                 resolve_adapter: Callable[[str, str, int, int], Active | None] | None = None) -> None:
        super().__init__(info, request_timeout=request_timeout, require_encryption=require_encryption)
        self.backend, self.sessions, self.check_hidden, self.chain = backend, sessions, check_hidden, chain
        self.check_blocks = check_blocks  # the peer's span check (a ``moved:`` refusal for a span it left)
        self.resolve_adapter = resolve_adapter  # what a session naming an adapter runs with (issue 19)

    async def open(self, request: InferenceOpen, call: Call) -> Responses:
        """Open (or resume) a session."""
        owned = call.stream.owned
        try:
            if not 1 <= request.batch_size <= self.info.max_batch_size:
                raise RequestError(f"batch_size must be in 1..{self.info.max_batch_size} on this peer")
            if not request.resume:
                if self.check_blocks is not None:
                    self.check_blocks(request.start, request.end)
                self.chain.check_open(request.upstream, request.downstream)
                Codec.parse(request.compression or "none")  # ValueError: refused, with what it takes
            adapter = None
            if request.adapter and not request.resume:
                if self.resolve_adapter is None:
                    raise RequestError("this peer runs no adapters")
                adapter = self.resolve_adapter(call.caller, request.adapter, request.start, request.end)
            live = any(self.sessions.sessions.get(i) is s for i, s in owned.items())
            session = await self.sessions.open(request, call.caller, (self.info.start, self.info.end),
                                               wait=0.0 if live else None)
        except (RequestError, ValueError) as e:
            logger.info("rpc_inference(peer=%s) open refused: %s", short_id(call.caller), e)
            return [reply(error=str(e))]
        if not request.resume:
            session.adapter = adapter
        owned[session.session_id] = session
        return [reply(length=session.length)]

    async def close(self, request: InferenceClose, call: Call) -> Responses:
        """Free (or detach) sessions of this stream; no reply."""
        for session_id in request.session_ids:
            if call.stream.owned.pop(session_id, None) is not None:
                (self.sessions.detach if request.detach else self.sessions.close)(session_id)
        return []

    async def steps(self, request: InferenceStep, call: Call) -> Responses | Deferred:
        """Validate each part, run the valid ones (the backend batches them), reply with outputs and errors.
        Steps of chained sessions (an upstream or downstream peer) go to ``peers.server.chain_calls``."""
        try:
            hidden = await self.read_tensor(call) if call.message.tensors else None
            started = time.perf_counter()  # from here on, the time is ours, not the network's
            sessions = self._sessions(request, call.stream.owned)
            if request.hold or any(s.chained for s in sessions):
                return self.chain.steps(request, call, sessions, hidden)
            if hidden is None:
                raise RequestError("this request must carry a tensor")
            parts = self._split(sessions, request, hidden)
        except (RequestError, ValueError, asyncio.TimeoutError) as e:
            error = str(e) or f"step exceeded the deadline of {self.request_timeout:.0f} s"
            logger.info("rpc_inference step refused: %s", error)
            return [reply(error=error)]
        errors, tasks = [], []
        for session, part, position in parts:
            try:
                check_step(session, part, position)
            except RequestError as e:
                errors.append(str(e))
                continue
            errors.append("")
            session.last_used = time.monotonic()
            tasks.append(self.backend.inference_step(session, part, position))
        try:
            async with deadline(self.request_timeout):
                outputs = await asyncio.gather(*tasks)
        except asyncio.TimeoutError:
            return [reply(error=f"step exceeded the deadline of {self.request_timeout:.0f} s")]
        if not outputs:
            return [runtime_pb2.ExpertResponse(metadata=InferenceReply(errors=errors).to_bytes())]
        output = torch.cat(outputs)
        return tensor_reply(output, InferenceReply(errors=errors, compute_ms=elapsed_ms(started)), call.stream,
                            codec=codec_of([s.compression for s, _, _ in parts]))

    def _sessions(self, request: InferenceStep, owned: dict[str, Session]) -> list[Session]:
        ids, positions = request.session_ids, request.positions
        if not ids or len(ids) != len(positions) or len(set(ids)) != len(ids):
            raise RequestError("a step needs distinct session_ids and one position per session")
        sessions = []
        for session_id in ids:
            session = owned.get(session_id)
            if session is None:
                raise RequestError(f"session {session_id!r} is not open on this stream")
            if session.moved:  # opened on the span this peer left: a step already running finished there
                owned.pop(session_id)
                raise MovedError(session.moved)
            if self.sessions.sessions.get(session_id) is not session:
                owned.pop(session_id)
                raise RequestError(f"session {session_id!r} was freed after being idle; open a new one")
            sessions.append(session)
        return sessions

    def _split(self, sessions: list[Session], request: InferenceStep, hidden: torch.Tensor
               ) -> list[tuple[Session, torch.Tensor, int]]:
        positions = request.positions
        rows = [s.batch_size for s in sessions]
        self.check_hidden(hidden, max_rows=sum(rows))
        if hidden.shape[0] != sum(rows):
            raise RequestError(f"these sessions have {sum(rows)} rows in all, got {hidden.shape[0]}")
        if len(rows) > 1 and hidden.shape[0] * hidden.shape[1] > self.backend.max_batch_tokens:
            raise RequestError(f"a step of several sessions may carry up to {self.backend.max_batch_tokens} tokens")
        return list(zip(sessions, hidden.split(rows), positions, strict=True))

