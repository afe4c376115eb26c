"""The stream of a stage peer: one per client, carrying its forwards and any number of its sessions.

The first request is a hello: the client's handshake (every tensor after it is sealed) and its admission proof
(``privacy.admission``; a private swarm refuses every other request of a stream whose hello it did not admit).
Requests are answered in order: a hello, an open and a forward get a reply, a step gets one reply (with a
tensor unless every part was refused), a close gets none. Steps of several sessions in one message are validated
part by part; a refused part leaves its session as it was and does not affect the others. A stream that ends without
closing its sessions detaches them: their caches wait ``session_timeout`` for a resume, like idle ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import torch
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError

from peers.aio import deadline
from peers.backend import StageBackend
from peers.framing import ERROR, FrameWriter, IncomingFrames, encode
from peers.protocol import (
    HEARTBEAT_METADATA,
    HEARTBEAT_PERIOD,
    ForwardRequest,
    InferenceClose,
    InferenceHello,
    InferenceOpen,
    InferenceReply,
    InferenceStep,
    ParamsFetch,
    ParamsPush,
    RequestError,
    StageInfo,
    TrainApply,
    TrainBackward,
    TrainForward,
    TrainOpen,
    read_tensor_messages,
    sealer,
    tensor_messages,
    unpack_inference,
    unsealer,
)
from peers.sessions import Session, SessionRegistry
from peers.training_rpc import TrainingRPC, training_refusal
from privacy.admission import Admission, caller_key, proof_context
from privacy.channel import SecureChannel, accept_handshake
from privacy.identity import Identity

logger = logging.getLogger(__name__)

MAX_STREAMS, MAX_STREAMS_PER_CALLER = 512, 16  # each may pin one unfinished frame (<= 1.25 MiB) for a while
HEARTBEAT_FRAME = encode(runtime_pb2.ExpertResponse(metadata=HEARTBEAT_METADATA))


class InferenceRPC:
    """Serves inference streams for one backend; ``check_hidden`` is the handler's tensor validation."""

    def __init__(self, backend: StageBackend, info: StageInfo, sessions: SessionRegistry, *,
                 request_timeout: float, check_hidden, check_blocks, identity: Identity,
                 require_encryption: bool = True, admission: Admission | None = None,
                 training: TrainingRPC | None = None) -> None:
        self.backend, self.info, self.sessions = backend, info, sessions
        self.request_timeout, self.check_hidden, self.check_blocks = request_timeout, check_hidden, check_blocks
        self.identity, self.require_encryption = identity, require_encryption
        self.admission = admission or Admission()
        self.training = training
        self.open_streams: dict[str, int] = {}  # caller -> its streams open now

    async def handle_stream(self, info: StreamInfo, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> None:
        """One client's stream, framed by ``peers.framing`` (hivemind's format, size-capped on arrival).

        The stream lives until the client ends it or goes away: an idle stream is never closed on a timer (its
        sessions are freed by the registry's timeout), so a client never meets a stream that died in silence.
        """
        caller = str(info.peer_id)
        out = FrameWriter(writer)
        if refusal := self._too_many_streams(caller):
            logger.info("Refused a stream from ...%s: %s", caller[-6:], refusal)
            with contextlib.suppress(ConnectionError, OSError):
                await out.send(encode(RPCError(message=refusal), ERROR))
            return out.close()
        self.open_streams[caller] = self.open_streams.get(caller, 0) + 1
        requests = IncomingFrames(reader, runtime_pb2.ExpertRequest, name=f"stream from ...{caller[-6:]}")
        stream = _Stream(admitted=not self.admission.required)
        heartbeat = asyncio.create_task(self._heartbeat(stream, requests, out))
        try:
            async for responses in self.serve(requests, caller, stream):
                await out.send(*(encode(r) for r in responses))
        except (ConnectionError, OSError):
            pass  # the client went away while we answered
        finally:
            if (left := self.open_streams.pop(caller) - 1) > 0:
                self.open_streams[caller] = left
            heartbeat.cancel()
            requests.close()
            end = requests.end.error if requests.end is not None else ""
            if end and "broke the framing" in end:
                logger.warning("Closing %s", end)
                with contextlib.suppress(ConnectionError, OSError):
                    await out.send(encode(RPCError(message=end), ERROR))
            out.close()

    def _too_many_streams(self, caller: str) -> str:
        """Streams are cheap to open and each may hold an unfinished frame (``peers.framing``): bound them."""
        if self.open_streams.get(caller, 0) >= MAX_STREAMS_PER_CALLER:
            return (f"too many streams: this peer keeps at most {MAX_STREAMS_PER_CALLER} open per caller (one "
                    f"per client is enough: every session and call shares it)")
        if sum(self.open_streams.values()) >= MAX_STREAMS:
            return f"too many streams: this peer keeps at most {MAX_STREAMS} open; try another peer"
        return ""

    async def _heartbeat(self, stream: _Stream, requests: IncomingFrames, out: FrameWriter) -> None:
        """While the stream has work in hand, tell a client that asked (its hello) that we are alive."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(HEARTBEAT_PERIOD / 2)
            if stream.heartbeat and (stream.busy or requests.queued) and \
                    loop.time() - out.last_write >= HEARTBEAT_PERIOD:
                try:
                    await out.send(HEARTBEAT_FRAME)
                except (ConnectionError, OSError):
                    return

    async def serve(self, requests: IncomingFrames, owner: str, stream: _Stream
                    ) -> AsyncIterator[list[runtime_pb2.ExpertResponse]]:
        """The replies to each request of one stream, in order (an empty list: no reply is due)."""
        owned: dict[str, Session] = {}
        try:
            while (message := await requests.get()) is not None:
                stream.busy = True
                try:
                    responses = await self._dispatch(message, requests, owner, owned, stream)
                except (RequestError, ValueError, asyncio.TimeoutError) as e:
                    responses = [reply(error=str(e) or "the request exceeded its deadline")]
                except Exception as e:  # a bug must cost one request, not the stream and its sessions
                    logger.warning("A request from ...%s failed: %r", owner[-6:], e)
                    responses = [reply(error=f"internal error: {type(e).__name__}: {e}")]
                finally:
                    stream.busy = False
                yield responses
        finally:
            for session_id in owned:
                self.sessions.detach(session_id)
            if self.training is not None:
                self.training.stream_closed(stream)

    async def _dispatch(self, message: runtime_pb2.ExpertRequest, requests: IncomingFrames, owner: str,
                        owned: dict, stream: _Stream) -> list[runtime_pb2.ExpertResponse]:
        try:
            request = unpack_inference(message.metadata)
        except ValueError as e:
            await self._skip_tensor(requests, message)
            logger.info("Refused a request from ...%s: %s", owner[-6:], e)
            return [reply(error=str(e))]
        if isinstance(request, InferenceHello):
            return [self._hello(request, stream, owner)]
        if refusal := self._refusal(stream):
            await self._skip_tensor(requests, message)
            return [] if isinstance(request, InferenceClose) else [reply(error=refusal)]
        if isinstance(request, ForwardRequest):
            return await self._forward(request, requests, message, stream, owner)
        if isinstance(request, TRAINING_KINDS) and (refusal := training_refusal(self.training, request, owner)):
            await self._skip_tensor(requests, message)  # not a trainer this peer's operator allowed (--trainers)
            return [reply(error=refusal)]
        if isinstance(request, TrainOpen):
            return [await self._train_open(request, stream)]
        if isinstance(request, TrainApply):
            return [await self._train_apply(request, stream)]
        if isinstance(request, (TrainForward, TrainBackward, ParamsPush)):
            return await self._train_call(request, requests, message, stream, owner)
        if isinstance(request, ParamsFetch):
            return self._params_fetch(request, stream)
        if isinstance(request, InferenceOpen):
            return [await self._open(request, owner, owned)]
        if isinstance(request, InferenceClose):
            self._close(request, owned)
            return []
        return await self._steps(request, requests, message, owned, stream)

    def _refusal(self, stream: _Stream) -> str:
        """Why this stream may not make requests (never admitted, or its certificate expired or was revoked)."""
        if not stream.admitted:
            return ("not admitted: this peer serves only members of its private swarm; open the stream with a "
                    "hello that carries a membership proof")
        if stream.channel is None and self.require_encryption:
            return "this peer only takes encrypted streams: send a hello (handshake) first"
        try:
            self.admission.recheck(stream.member)
        except ValueError as e:
            return f"not admitted any more: {e}"
        return ""

    def _hello(self, request: InferenceHello, stream: _Stream, caller: str) -> runtime_pb2.ExpertResponse:
        """Admission, then key agreement: from now on every tensor on this stream is sealed (``privacy.channel``).

        The proof is bound to this RPC, this peer and the client's hello (its fresh X25519 key), so it cannot be
        replayed on another stream or to another peer.
        """
        if stream.hello_seen:
            return reply(error="this stream already had its hello")
        stream.hello_seen = True
        try:
            context_bytes = proof_context("rpc_inference", self.identity.public_bytes, request.hello)
            stream.member = self.admission.admit(request.proof, context_bytes, caller_key(PeerID.from_base58(caller)))
        except ValueError as e:
            logger.info("rpc_inference(peer=...%s) not admitted: %s", caller[-6:], e)
            return reply(error=f"not admitted: {e}")
        stream.admitted = True
        stream.heartbeat = request.heartbeat
        period = HEARTBEAT_PERIOD if request.heartbeat else 0.0
        if not request.hello:
            return runtime_pb2.ExpertResponse(metadata=InferenceReply(heartbeat=period).to_bytes())
        try:
            handshake, stream.channel = accept_handshake(request.hello, self.identity)
        except ValueError as e:
            return reply(error=f"handshake refused: {e}")
        return runtime_pb2.ExpertResponse(metadata=InferenceReply(handshake=handshake, heartbeat=period).to_bytes())

    async def _forward(self, request: ForwardRequest, requests: AsyncIterator, message: runtime_pb2.ExpertRequest,
                       stream: _Stream, owner: str = "") -> list[runtime_pb2.ExpertResponse]:
        """A stateless forward through ``[start, end)``: one sealed tensor in, one out."""
        try:
            hidden = await self._read_tensor(requests, message, stream)
            self.check_blocks(request.start, request.end)
            self.check_hidden(hidden)
            async with deadline(self.request_timeout):
                output = await self.backend.forward(hidden, request.start, request.end, owner)
        except (RequestError, ValueError, asyncio.TimeoutError) as e:
            error = str(e) or f"forward exceeded the deadline of {self.request_timeout:.0f} s"
            logger.info("forward(blocks=%s:%s) refused: %s", request.start, request.end, error)
            return [reply(error=error)]
        return list(tensor_messages(output, InferenceReply().to_bytes(), runtime_pb2.ExpertResponse,
                                    seal=stream.seal))

    async def _train_open(self, request: TrainOpen, stream: _Stream) -> runtime_pb2.ExpertResponse:
        try:
            step = await self.training.open(request, stream)
        except (RequestError, ValueError) as e:
            logger.info("train_open(run=%r) refused: %s", request.run_id, e)
            return reply(error=str(e))
        return runtime_pb2.ExpertResponse(metadata=InferenceReply(step=step).to_bytes())

    async def _train_apply(self, request: TrainApply, stream: _Stream) -> runtime_pb2.ExpertResponse:
        try:
            step = await self.training.apply(request, stream)
        except (RequestError, ValueError) as e:
            return reply(error=str(e))
        return runtime_pb2.ExpertResponse(metadata=InferenceReply(step=step).to_bytes())

    def _params_fetch(self, request: ParamsFetch, stream: _Stream) -> list[runtime_pb2.ExpertResponse]:
        try:
            flat = self.training.current_params(request)
        except RequestError as e:
            return [reply(error=str(e))]
        metadata = InferenceReply(step=self.training.step).to_bytes()
        return list(tensor_messages(flat, metadata, runtime_pb2.ExpertResponse, seal=stream.seal))

    async def _train_call(self, request: TrainForward | TrainBackward | ParamsPush, requests: AsyncIterator,
                          message: runtime_pb2.ExpertRequest, stream: _Stream,
                          sender: str) -> list[runtime_pb2.ExpertResponse]:
        """A training forward or backward (or a replica's parameters): one sealed tensor in, one out (or an
        empty reply); a refusal applies nothing."""
        try:
            tensor = await self._read_tensor(requests, message, stream)
            started = time.perf_counter()
            if isinstance(request, ParamsPush):
                self.training.receive_params(request, tensor, sender)
                return [reply()]
            if isinstance(request, TrainForward):
                self.check_hidden(tensor)
                output = await self.training.forward(request, tensor, stream)
            else:
                if request.recompute and tensor.ndim == 4:
                    self.check_hidden(tensor.flatten(0, 1), max_rows=2 * self.info.max_batch_size)
                else:
                    self.check_hidden(tensor)
                output = await self.training.backward(request, tensor, stream)
        except (RequestError, ValueError) as e:  # GradientError is a ValueError
            if isinstance(request, TrainBackward):
                self.training.drop(request, stream)  # a refused backward drops its micro-batch, applies nothing
            logger.info("%s(run=%r, %s) refused: %s", type(request).__name__, request.run_id,
                        getattr(request, "micro_id", getattr(request, "round", "")), e)
            return [reply(error=str(e))]
        compute_ms = 1e3 * (time.perf_counter() - started)
        metadata = InferenceReply(step=self.training.step, compute_ms=compute_ms).to_bytes()
        return list(tensor_messages(output, metadata, runtime_pb2.ExpertResponse, seal=stream.seal))

    async def _read_tensor(self, requests: AsyncIterator, message: runtime_pb2.ExpertRequest,
                           stream: _Stream) -> torch.Tensor:
        """The tensor a request carries; refused (and skipped) on a plaintext stream when encryption is required."""
        if stream.channel is None and self.require_encryption:
            await self._skip_tensor(requests, message)
            raise RequestError("this peer only takes encrypted streams: send a hello (handshake) first")
        if not message.tensors:
            raise RequestError("this request must carry a tensor")
        async with deadline(self.request_timeout):
            _, hidden = await read_tensor_messages(requests, self.info.max_request_bytes, first=message,
                                                   unseal=stream.unseal)
        return hidden

    async def _open(self, request: InferenceOpen, owner: str, owned: dict) -> runtime_pb2.ExpertResponse:
        """Open (or resume) a session; it waits for cache space only on a stream with no live session, whose
        later requests (steps of other sessions) would wait behind it."""
        try:
            if not 1 <= request.batch_size <= self.info.max_batch_size:
                raise RequestError(f"batch_size must be in 1..{self.info.max_batch_size} on this peer")
            live = any(self.sessions.sessions.get(i) is s for i, s in owned.items())
            session = await self.sessions.open(request, owner, (self.info.start, self.info.end),
                                               wait=0.0 if live else None)
        except (RequestError, ValueError) as e:
            logger.info("rpc_inference(peer=...%s) open refused: %s", owner[-6:], e)
            return reply(error=str(e))
        owned[session.session_id] = session
        return reply(length=session.length)

    def _close(self, request: InferenceClose, owned: dict) -> None:
        for session_id in request.session_ids:
            if isinstance(session_id, str) and owned.pop(session_id, None) is not None:
                (self.sessions.detach if request.detach else self.sessions.close)(session_id)

    async def _steps(
        self, request: InferenceStep, requests: AsyncIterator, message: runtime_pb2.ExpertRequest, owned: dict,
        stream: _Stream,
    ) -> list[runtime_pb2.ExpertResponse]:
        """Validate each part, run the valid ones (the backend batches them), reply with outputs and errors."""
        try:
            hidden = await self._read_tensor(requests, message, stream)
            parts = self._split(request, hidden, owned)
        except (RequestError, ValueError, asyncio.TimeoutError) as e:
            error = str(e) or f"step exceeded the deadline of {self.request_timeout:.0f} s"
            logger.info("rpc_inference step refused: %s", error)
            return [reply(error=error)]
        errors, tasks = [], []
        for session, part, position in parts:
            try:
                _check_step(session, part, position)
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
        metadata = InferenceReply(errors=errors).to_bytes()
        if not outputs:
            return [runtime_pb2.ExpertResponse(metadata=metadata)]
        return list(tensor_messages(torch.cat(outputs), metadata, runtime_pb2.ExpertResponse, seal=stream.seal))

    def _split(self, request: InferenceStep, hidden: torch.Tensor, owned: dict) -> list:
        ids, positions = request.session_ids, request.positions
        if not ids or len(ids) != len(positions) or len(set(map(str, ids))) != len(ids):
            raise RequestError("a step needs distinct session_ids and one position per session")
        if not all(isinstance(i, str) for i in ids) or not all(_is_int(p) for p in positions):
            raise RequestError("session_ids must be strings and positions integers")
        sessions = []
        for session_id in ids:
            session = owned.get(session_id)
            if session is None:
                raise RequestError(f"session {session_id!r} is not open on this stream")
            if self.sessions.sessions.get(session_id) is not session:
                owned.pop(session_id)
                raise RequestError(f"session {session_id!r} was freed after being idle; open a new one")
            sessions.append(session)
        rows = [s.batch_size for s in sessions]
        self.check_hidden(hidden, max_rows=sum(rows))
        if hidden.shape[0] != sum(rows):
            raise RequestError(f"these sessions have {sum(rows)} rows in all, got {hidden.shape[0]}")
        if len(rows) > 1 and hidden.shape[0] * hidden.shape[1] > self.backend.max_batch_tokens:
            raise RequestError(f"a step of several sessions may carry up to {self.backend.max_batch_tokens} tokens")
        return list(zip(sessions, hidden.split(rows), positions, strict=True))

    async def _skip_tensor(self, requests: AsyncIterator, message: runtime_pb2.ExpertRequest) -> None:
        """Consume the rest of a refused message's tensor, so that the stream stays in step."""
        if message.tensors:
            try:
                await read_tensor_messages(requests, self.info.max_request_bytes, first=message)
            except (RequestError, ValueError):
                pass


TRAINING_KINDS = (TrainOpen, TrainApply, TrainForward, TrainBackward, ParamsPush, ParamsFetch)


class _Stream:
    """Per-stream state: admitted or not, and the encrypted channel once a hello has set it up."""

    def __init__(self, *, admitted: bool) -> None:
        self.admitted, self.hello_seen, self.member = admitted, False, None  # member: what admission returned
        self.heartbeat = False  # the client asked for heartbeats while we work on its requests
        self.busy = False  # a request is being handled
        self.channel: SecureChannel | None = None

    @property
    def seal(self):
        return sealer(self.channel)

    @property
    def unseal(self):
        return unsealer(self.channel)


def _check_step(session: Session, part: torch.Tensor, position: int) -> None:
    if not 0 <= position <= session.length:
        raise RequestError(f"step starts at token {position} but the session holds {session.length}")
    if position + part.shape[1] > session.max_length:
        raise RequestError(
            f"step would reach {position + part.shape[1]} tokens, beyond the session's max_length "
            f"{session.max_length}; open a session with a larger max_length"
        )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def reply(*, error: str = "", length: int = 0) -> runtime_pb2.ExpertResponse:
    return runtime_pb2.ExpertResponse(metadata=InferenceReply(error=error, length=length).to_bytes())
