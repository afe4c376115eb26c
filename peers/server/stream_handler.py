"""The stream of a stage peer: one per client, carrying its forwards, any number of its sessions and its training.

The first request is a hello: the client's handshake (every tensor after it is sealed) and its admission proof
(``privacy.admission``; a private swarm refuses every other request of a stream whose hello it did not admit).
Every later request goes to the handler of its kind (``StreamHandler.handlers``); replies come back in order (a
close gets none). A stream that ends without closing its sessions detaches them: their caches wait
``session_timeout`` for a resume, like idle ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError

from peers.core.aio import deadline
from peers.model.adapters import Active
from peers.server import metrics
from peers.server.backend import StageBackend
from peers.server.calls import (
    Call,
    Deferred,
    Handler,
    Responses,
    StreamCalls,
    StreamState,
    elapsed_ms,
    reply,
    tensor_reply,
)
from peers.server.chain_calls import ChainCalls, StreamFor
from peers.server.kv_sessions import SessionRegistry
from peers.server.probe_calls import ProbeCalls, ProbeLimiter
from peers.server.session_calls import SessionCalls
from peers.server.training_calls import TRAINING_KINDS, TrainingCalls
from peers.server.training_rpc import TrainingRPC, training_refusal
from peers.wire.errors import RequestError
from peers.wire.framing import ERROR, FrameWriter, IncomingFrames, encode
from peers.wire.messages import (
    AdapterLoad,
    ForwardRequest,
    InferenceClose,
    InferenceHello,
    InferenceOpen,
    InferencePush,
    InferenceRelink,
    InferenceReplay,
    InferenceReply,
    InferenceStep,
    LinkProbe,
    ParamsFetch,
    ParamsPush,
    StageInfo,
    TrainApply,
    TrainBackward,
    TrainFetch,
    TrainForward,
    TrainOpen,
    TrainPush,
    unpack_inference,
)
from peers.wire.service import HEARTBEAT_METADATA, HEARTBEAT_PERIOD
from privacy.admission import Admission, caller_key, proof_context
from privacy.channel import accept_handshake
from privacy.identity import Identity
from privacy.peer_ids import short_id
from swarm.compression import Codec

logger = logging.getLogger(__name__)

MAX_STREAMS, MAX_STREAMS_PER_CALLER = 512, 16  # each may pin one unfinished frame (<= 1.25 MiB) for a while
MAX_REPLIES_QUEUED = 64  # replies (or deferred ones) waiting to be written; then the stream stops reading requests
HEARTBEAT_FRAME = encode(runtime_pb2.ExpertResponse(metadata=HEARTBEAT_METADATA))


class StreamHandler(StreamCalls):
    """Serves the streams of one peer; ``check_hidden`` and ``check_blocks`` are the handler's validation."""

    # training kinds whose handler checks the caller itself (not against the trainers: e.g. a graph replica's push)
    checked_by_handler: tuple[type, ...] = ()

    def __init__(self, backend: StageBackend | None, info: StageInfo, sessions: SessionRegistry, *,
                 request_timeout: float, check_hidden: Callable[..., None], check_blocks: Callable[[int, int], None],
                 identity: Identity, require_encryption: bool = True, admission: Admission | None = None,
                 training: TrainingRPC | None = None, stream_for: StreamFor | None = None) -> None:
        super().__init__(info, request_timeout=request_timeout, require_encryption=require_encryption)
        self.check_hidden, self.check_blocks = check_hidden, check_blocks
        self.identity, self.admission = identity, admission or Admission()
        self.stream_for = stream_for
        self.open_streams: dict[str, int] = {}  # caller -> its streams open now
        self.probes = ProbeCalls(ProbeLimiter(), info, request_timeout=request_timeout,
                                 require_encryption=require_encryption)
        self.switch(backend, info, sessions, training)

    def switch(self, backend: StageBackend | None, info: StageInfo, sessions: SessionRegistry,
               training: TrainingRPC | None, unserved: str = "") -> None:
        """Serve another span from the next request on, on every stream (the peer moved, ``StageServer.move_to``).
        Requests under way finish on the objects they started with. ``backend`` None (a backup): every request but
        hellos and probes gets ``unserved`` (a ``moved: ...`` refusal)."""
        self.info, self.backend, self.sessions, self.training, self.unserved = info, backend, sessions, training, \
            unserved
        timeout, encrypted = self.request_timeout, self.require_encryption
        self.probes.info = info
        self.handlers: dict[type, Handler] = {LinkProbe: self.probes.probe}
        if backend is None:
            return
        self.chain = ChainCalls(backend, sessions, info, check_hidden=self.check_hidden, request_timeout=timeout,
                                require_encryption=encrypted, stream_for=self.stream_for)
        inference = SessionCalls(backend, sessions, info, check_hidden=self.check_hidden, request_timeout=timeout,
                                 require_encryption=encrypted, chain=self.chain, check_blocks=self.check_blocks,
                                 resolve_adapter=self.resolve_adapter)
        self.handlers.update({
            ForwardRequest: self.forward, InferenceOpen: inference.open, InferenceStep: inference.steps,
            InferenceClose: inference.close, InferencePush: self.chain.push,
            InferenceRelink: self.chain.relink, InferenceReplay: self.chain.replay, AdapterLoad: self.load_adapter,
        })
        if training is not None:
            calls = TrainingCalls(training, info, check_hidden=self.check_hidden, request_timeout=timeout,
                                  require_encryption=encrypted)
            self.handlers.update({TrainOpen: calls.open, TrainApply: calls.apply, ParamsFetch: calls.fetch,
                                  TrainForward: calls.tensor_call, TrainBackward: calls.tensor_call,
                                  ParamsPush: calls.tensor_call, TrainPush: calls.push, TrainFetch: calls.fetch_kept})

    async def handle_stream(self, info: StreamInfo, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> None:
        """One client's stream, framed by ``peers.wire.framing`` (hivemind's format, size-capped on arrival).

        The stream lives until the client ends it or goes away: an idle stream is never closed on a timer (its
        sessions are freed by the registry's timeout), so a client never meets a stream that died in silence.
        """
        caller = str(info.peer_id)
        out = FrameWriter(writer, peer=caller)
        if refusal := self._too_many_streams(caller):
            logger.info("Refused a stream from %s: %s", short_id(caller), refusal)
            metrics.stream_refused()
            with contextlib.suppress(ConnectionError, OSError):
                await out.send(encode(RPCError(message=refusal), ERROR))
            return out.close()
        self.open_streams[caller] = self.open_streams.get(caller, 0) + 1
        requests = IncomingFrames(reader, runtime_pb2.ExpertRequest, name=f"stream from {short_id(caller)}",
                                  peer=caller)
        stream = StreamState(admitted=not self.admission.required)
        heartbeat = asyncio.create_task(self._heartbeat(stream, requests, out))
        replies: asyncio.Queue = asyncio.Queue(maxsize=MAX_REPLIES_QUEUED)  # in request order; bounded: backpressure
        writer = asyncio.create_task(self._write_replies(replies, stream, out))
        try:
            async for responses in self.serve(requests, caller, stream):
                if isinstance(responses, Deferred):
                    stream.deferred += 1
                await replies.put(responses)
            await replies.put(None)
            await writer
        except (ConnectionError, OSError):
            pass  # the client went away while we answered
        finally:
            writer.cancel()
            while not replies.empty():  # deferred requests nobody will read the replies of
                if isinstance(item := replies.get_nowait(), Deferred):
                    item.task.cancel()
            if (left := self.open_streams.pop(caller) - 1) > 0:
                self.open_streams[caller] = left
            heartbeat.cancel()
            requests.close()
            if requests.end is not None and requests.end.broken_framing:
                logger.warning("Closing %s", requests.end.error)
                with contextlib.suppress(ConnectionError, OSError):
                    await out.send(encode(RPCError(message=requests.end.error), ERROR))
            out.close()

    @staticmethod
    async def _write_replies(replies: asyncio.Queue, stream: StreamState, out: FrameWriter) -> None:
        """Write each request's replies in order, waiting for a deferred one's when its turn comes."""
        gone = False  # the client went away: keep taking (and dropping) replies until the serve loop ends
        while (item := await replies.get()) is not None:
            if isinstance(item, Deferred):
                if gone:
                    item.task.cancel()
                try:
                    item = [] if gone else await item.task
                except asyncio.CancelledError:
                    if not item.task.cancelled():
                        raise
                    item = []
                finally:
                    stream.deferred -= 1
            if not gone:
                try:
                    await out.send(*(encode(r) for r in item))
                except (ConnectionError, OSError):
                    gone = True

    def _too_many_streams(self, caller: str) -> str:
        """Streams are cheap to open and each may hold an unfinished frame (``peers.wire.framing``): bound them."""
        if self.open_streams.get(caller, 0) >= MAX_STREAMS_PER_CALLER:
            return (f"too many streams: this peer keeps at most {MAX_STREAMS_PER_CALLER} open per caller (one "
                    f"per client is enough: every session and call shares it)")
        if sum(self.open_streams.values()) >= MAX_STREAMS:
            return f"too many streams: this peer keeps at most {MAX_STREAMS} open; try another peer"
        return ""

    async def _heartbeat(self, stream: StreamState, requests: IncomingFrames, out: FrameWriter) -> None:
        """While the stream has work in hand, tell a client that asked (its hello) that we are alive."""
        loop = asyncio.get_running_loop()
        await stream.heartbeat.wait()  # streams whose hello did not ask cost no wake-ups
        while True:
            await asyncio.sleep(HEARTBEAT_PERIOD / 2)
            if (stream.busy or stream.deferred or requests.queued) and loop.time() - out.last_write >= HEARTBEAT_PERIOD:
                try:
                    await out.send(HEARTBEAT_FRAME)
                except (ConnectionError, OSError):
                    return

    async def serve(self, requests: IncomingFrames, caller: str, stream: StreamState
                    ) -> AsyncIterator[Responses | Deferred]:
        """The replies to each request of one stream, in order (an empty list: no reply is due; a ``Deferred``: it
        comes later, while the next requests are handled)."""
        try:
            while (message := await requests.get()) is not None:
                stream.busy = True
                call = Call(message, requests, caller, stream)
                started = time.perf_counter()
                try:
                    responses = await self._dispatch(call)
                except (RequestError, ValueError, asyncio.TimeoutError) as e:
                    responses = [reply(error=str(e) or "the request exceeded its deadline")]
                except Exception as e:  # a bug must cost one request, not the stream and its sessions
                    logger.warning("A request from %s failed: %r", short_id(caller), e)
                    responses = [reply(error=f"internal error: {type(e).__name__}: {e}")]
                finally:
                    stream.busy = False
                metrics.request_done(call.kind, responses, started)
                yield responses
        finally:
            for session_id, session in stream.owned.items():
                if not session.moved:  # those of a span we left are freed with it
                    self.sessions.detach(session_id)
            if self.training is not None:
                self.training.stream_closed(stream)

    async def _dispatch(self, call: Call) -> Responses | Deferred:
        try:
            request = unpack_inference(call.message.metadata)
        except ValueError as e:
            await self.skip_tensor(call)
            logger.info("Refused a request from %s: %s", short_id(call.caller), e)
            return [reply(error=str(e))]
        call.kind = type(request).__name__
        if isinstance(request, InferenceHello):
            return [self._hello(request, call.stream, call.caller)]
        refusal = self._refusal(call.stream)
        if not refusal and self.unserved and not isinstance(request, LinkProbe):
            refusal = self.unserved  # a backup serves no blocks (a moved: refusal)
        if not refusal and isinstance(request, TRAINING_KINDS) and not isinstance(request, self.checked_by_handler):
            refusal = training_refusal(self.training, request, call.caller, call.stream)  # an allowed trainer?
        if refusal:
            await self.skip_tensor(call)
            return [] if isinstance(request, InferenceClose) else [reply(error=refusal)]
        return await self.handlers[type(request)](request, call)

    def _refusal(self, stream: StreamState) -> str:
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

    def _hello(self, request: InferenceHello, stream: StreamState, caller: str) -> runtime_pb2.ExpertResponse:
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
            logger.info("rpc_inference(peer=%s) not admitted: %s", short_id(caller), e)
            return reply(error=f"not admitted: {e}")
        stream.admitted = True
        if request.heartbeat:
            stream.heartbeat.set()
        period = HEARTBEAT_PERIOD if request.heartbeat else 0.0
        if not request.hello:
            return runtime_pb2.ExpertResponse(metadata=InferenceReply(heartbeat=period).to_bytes())
        try:
            handshake, stream.channel = accept_handshake(request.hello, self.identity)
        except ValueError as e:
            return reply(error=f"handshake refused: {e}")
        return runtime_pb2.ExpertResponse(metadata=InferenceReply(handshake=handshake, heartbeat=period).to_bytes())

    def resolve_adapter(self, caller: str, name: str, start: int, end: int) -> Active | None:
        """The LoRA a request of ``caller`` naming adapter ``name`` runs with (``peers.server.session_adapters``)."""
        if not name:
            return None
        runs = self.training.adapter_runs if self.training is not None else None
        if runs is None:
            raise RequestError("this peer runs no adapters: its operator started it with --adapters none")
        return runs.resolve(caller, name, start, end)

    async def load_adapter(self, request: AdapterLoad, call: Call) -> Responses:
        """Keep the caller's adapters (an exported folder's) for its own sessions and forwards on our blocks."""
        try:
            flat = await self.read_tensor(call) if call.message.tensors else None
            runs = self.training.adapter_runs if self.training is not None else None
            if runs is None or not runs.policy.allows(call.caller):
                raise RequestError("this peer runs no adapters for you (its operator's --adapters)")
            runs.sessions.load(call.caller, request, flat)
        except (RequestError, ValueError) as e:
            logger.info("adapter_load(%r) from %s refused: %s", request.name[:64], short_id(call.caller), e)
            return [reply(error=str(e))]
        return [reply()]

    async def forward(self, request: ForwardRequest, call: Call) -> Responses:
        """A stateless forward through ``[start, end)``: one sealed tensor in, one out."""
        try:
            hidden = await self.read_tensor(call)
            started = time.perf_counter()  # from here on, the time is ours, not the network's
            self.check_blocks(request.start, request.end)
            self.check_hidden(hidden)
            codec = Codec.parse(request.compression or "none")
            backend = self.backend
            assert backend is not None  # a backup has no forward handler
            adapter = self.resolve_adapter(call.caller, request.adapter, request.start, request.end)
            async with deadline(self.request_timeout):
                output = await backend.forward(hidden, request.start, request.end, call.caller, adapter)
        except (RequestError, ValueError, asyncio.TimeoutError) as e:
            error = str(e) or f"forward exceeded the deadline of {self.request_timeout:.0f} s"
            logger.info("forward(blocks=%s:%s) refused: %s", request.start, request.end, error)
            return [reply(error=error)]
        return tensor_reply(output, InferenceReply(compute_ms=elapsed_ms(started)), call.stream, codec=codec)
