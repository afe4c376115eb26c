"""``PeerStream``: a client's one long-lived inference stream to one peer, shared by all its sessions there.

Steps that sessions issue while another step is in flight on the stream wait, and leave together in one
message (when they have the same number of new tokens): with many concurrent sessions the peer gets large
batches and the wire carries one message per round instead of one per session. Replies come back in order.
If the stream breaks or a reply is late, every pending request fails at once and the stream is dropped, so
that each session re-routes (see ``peers.client.inference_session``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from peers.model.graph.trace import EdgeSpec
from peers.wire import activity
from peers.wire.edges import edge_messages, read_edge_messages
from peers.wire.errors import RequestError, refusal_or_failure
from peers.wire.framing import FrameWriter, IncomingFrames, encode, end_of_stream
from peers.wire.messages import (
    ForwardRequest,
    InferenceClose,
    InferenceHello,
    InferenceOpen,
    InferencePush,
    InferenceReply,
    InferenceStep,
    Message,
    pack_inference,
)
from peers.wire.service import HEARTBEAT_METADATA, INFERENCE_HANDLE
from peers.wire.tensors import MAX_REPLY_BYTES, read_coded_messages, sealer, tensor_messages, unsealer
from privacy.admission import Admission, proof_context
from privacy.channel import ClientHandshake, SecureChannel, new_session_id
from privacy.errors import ChannelError, MembershipError
from privacy.peer_ids import public_key_of, short_id
from swarm.compression import NONE, Codec, Encoded

logger = logging.getLogger(__name__)

Observer = Callable[[str, float, float, int], None]  # (peer id, wall s, the peer's reported compute s, bytes both ways)

MAX_COALESCED_TOKENS = 512  # rows x new tokens of the steps sent together in one message
LIVENESS_TIMEOUT = 3.0  # seconds of silence (no reply, no heartbeat) with requests pending: the peer is gone


@dataclass(eq=False)
class _Due:
    """A reply we wait for: its future and timer, and what a link sample needs (``sent`` is None: no sample)."""

    future: asyncio.Future
    timer: asyncio.TimerHandle | None
    began: float = 0.0  # ``time.perf_counter()`` when the request was queued (uvloop's clock counts whole ms)
    sent: int | None = None  # bytes of the request, if it had the stream to itself (no reply due before it)
    coded: bool = False  # the future gets (reply, tensor, top-k indices) instead of (reply, tensor)
    bundle: tuple | None = None  # (edge specs, graph hash): the reply's tensors are an edge bundle (``submit_bundle``)


@dataclass(eq=False)
class _Step:
    """A session's step (or, ``push``, a peer's push into a session of the next peer) waiting to be sent."""

    session_id: str
    position: int
    hidden: torch.Tensor | None  # None: a chain step whose input the peer gets from its upstream
    timeout: float
    future: asyncio.Future = field(repr=False)
    rows: int = 0  # rows of its output in the reply (0: none, its output goes downstream)
    hold: bool = False
    push: bool = False
    tokens: int = 0  # new tokens (of the pushed input, when ``hidden`` is None)
    codec: Codec = NONE  # how ``hidden`` travels
    indices: torch.Tensor | None = field(default=None, repr=False)  # top-k's forced pattern (travels alone)

    @property
    def group(self) -> tuple:
        """Steps travel together only with steps of the same kind, codec and number of new tokens (replies
        concatenate their outputs); a step with forced top-k indices travels alone."""
        tokens = self.tokens if self.hidden is None else self.hidden.shape[1]
        alone = id(self) if self.indices is not None else 0
        return self.push, self.hold, self.hidden is None, tokens, self.codec, alone


class PeerStream:
    """One stream to ``peer_id``; create with ``await PeerStream.connect(...)``."""

    def __init__(self, p2p: P2P, peer_id: str, observe: Observer | None = None) -> None:
        self.p2p, self.peer_id = p2p, peer_id
        self.observe = observe  # told each reply's timing: passive link measurement (``swarm.links``)
        self.closed = False
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._waiting: deque[_Due] = deque()  # replies due, in order
        self._pending: list[_Step] = []
        self._in_flight = False
        self._flush_scheduled = False
        self._reader: asyncio.Task | None = None
        self._writer: asyncio.Task | None = None
        self._watchdog: asyncio.Task | None = None
        self._replies: IncomingFrames | None = None
        self.step_messages = 0  # step messages sent (each may carry several sessions' steps)
        self.bytes_sent = self.bytes_received = 0  # message bytes both ways (heartbeats included)
        self._channel: SecureChannel | None = None  # set by the handshake: seals every tensor both ways
        self._idle_until = 0.0  # loop time when the pending requests started (liveness counts from then)

    @classmethod
    async def connect(cls, p2p: P2P, peer_id: str, *, encrypt: bool = True, timeout: float = 30.0,
                      admission: Admission | None = None, liveness_timeout: float = LIVENESS_TIMEOUT,
                      observe: Observer | None = None) -> PeerStream:
        """Open the stream; with ``encrypt``, agree on keys with the peer whose public key is ``peer_id``.

        Every tensor on an encrypted stream is sealed with AES-GCM under keys only this client and that peer
        hold: relays, other peers and the p2p daemons see ciphertext (shapes and dtypes stay visible). The hello
        also carries ``admission``'s proof (a private swarm's membership proof, bound to this handshake) and asks
        for heartbeats: while a request is pending, a peer that sends nothing for ``liveness_timeout`` seconds
        is taken for gone (a peer that dies closes the stream, which fails the pending requests at once).

        ``observe(peer_id, wall, compute, nbytes)`` is told the timing of each reply that reports the peer's own
        time on it (``InferenceReply.compute_ms`` > 0), for requests sent while no other reply was due (a request
        queued behind another would count the other's compute as network time).
        """
        admission = admission or Admission()
        stream = cls(p2p, peer_id, observe)
        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), INFERENCE_HANDLE)
        stream._start(reader, writer)
        try:
            peer_key = public_key_of(peer_id)
            handshake = ClientHandshake(peer_key, new_session_id()) if encrypt else None
            hello = handshake.hello() if handshake else b""
            proof = admission.proof(proof_context("rpc_inference", peer_key, hello)) if admission.required else b""
            metadata = pack_inference(InferenceHello(hello=hello, proof=proof, heartbeat=True))
            reply, _ = await stream._request(metadata, None, timeout, observe=False)
            if reply.error:
                error = MembershipError if reply.error.startswith("not admitted") else ChannelError
                raise error(f"peer {short_id(peer_id)} refused the stream: {reply.error}")
            if handshake is not None:
                stream._channel = handshake.finish(reply.handshake)
            if reply.heartbeat > 0:
                limit = max(liveness_timeout, 3 * reply.heartbeat)
                stream._watchdog = asyncio.create_task(stream._watch(limit))
        except BaseException:
            stream.shutdown()
            raise
        return stream

    @classmethod
    async def without_hello(cls, p2p: P2P, peer_id: str) -> PeerStream:
        """A stream that skips the hello (no handshake, no proof, no heartbeats): what a careless or hostile
        client sends; for tests of what peers refuse."""
        stream = cls(p2p, peer_id)
        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), INFERENCE_HANDLE)
        stream._start(reader, writer)
        return stream

    def send_raw(self, messages: list[runtime_pb2.ExpertRequest], *, hang_up: bool = False) -> asyncio.Future:
        """Queue hand-made ``messages`` as they are and return the future of the next reply (``hang_up``: end the
        stream after them); for tests of what peers refuse (truncated, tampered or replayed requests)."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.append(_Due(future, None))
        for message in messages:
            self._outbox.put_nowait(message)
        if hang_up:
            self._outbox.put_nowait(None)
        return future

    def _start(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._replies = IncomingFrames(reader, runtime_pb2.ExpertResponse, max_queued=64,
                                       name=f"stream to peer {short_id(self.peer_id)}", peer=self.peer_id)
        # closed when the reader ends: the end-of-stream frame is only a half-close
        self._out = FrameWriter(writer, peer=self.peer_id)
        self._writer = asyncio.create_task(self._write(self._out))
        self._reader = asyncio.create_task(self._read(self._frames()))

    async def forward(self, start: int, end: int, hidden: torch.Tensor, timeout: float, *, codec: Codec = NONE,
                      adapter: str = "") -> torch.Tensor:
        """Blocks ``[start, end)`` of the peer on ``hidden`` (no session); ``RequestError`` if refused. ``codec``:
        how ``hidden`` travels, and asks the peer to send its output the same way; ``adapter``: the LoRA to run with
        (``ForwardRequest.adapter``)."""
        request = ForwardRequest(start=start, end=end, compression="" if codec.exact else str(codec), adapter=adapter)
        reply, output = await self._request(pack_inference(request), hidden, timeout, codec=codec)
        if reply.error or output is None:
            raise RequestError(f"peer {short_id(self.peer_id)} refused blocks {start}:{end}: "
                               f"{reply.error or 'no output in the reply'}")
        return output

    async def call(self, message: Message, tensor: torch.Tensor | Encoded | None, timeout: float, *,
                   observe: bool = True, codec: Codec = NONE, indices: torch.Tensor | None = None
                   ) -> tuple[InferenceReply, torch.Tensor | None]:
        """Send one request (e.g. a training call) and return its reply; ``RequestError`` if it was refused.
        ``observe=False``: its timing is not a passive link sample (a probe reports its own). ``codec`` (and
        ``indices``, top-k's forced pattern): how ``tensor`` travels (an ``Encoded`` one travels as it is)."""
        reply, output, _ = await self.call_coded(message, tensor, timeout, observe=observe, codec=codec,
                                                 indices=indices)
        return reply, output

    async def call_coded(self, message: Message, tensor: torch.Tensor | Encoded | None, timeout: float, *,
                         observe: bool = True, codec: Codec = NONE, indices: torch.Tensor | None = None
                         ) -> tuple[InferenceReply, torch.Tensor | None, torch.Tensor | None]:
        """``call``, with the sorted flat indices of a top-k reply tensor (None for other codecs)."""
        future = self._send(pack_inference(message), tensor, timeout, observe=observe, codec=codec, indices=indices,
                            coded=True)
        reply, output, kept = await future
        if reply.error:
            raise RequestError(f"peer {short_id(self.peer_id)} refused {type(message).__name__}: {reply.error}")
        return reply, output, kept

    async def open(self, request: InferenceOpen, timeout: float) -> InferenceReply:
        reply, _ = await self._request(pack_inference(request), None, timeout)
        return reply

    async def step(self, session_id: str, position: int, hidden: torch.Tensor, timeout: float, *,
                   codec: Codec = NONE) -> torch.Tensor:
        """The outputs of one session's step; may travel together with other sessions' steps (of the same codec)."""
        return await self.queue_step(session_id, position, hidden, timeout, rows=hidden.shape[0], codec=codec)

    def queue_step(self, session_id: str, position: int, hidden: torch.Tensor | None, timeout: float, *,
                   rows: int, hold: bool = False, push: bool = False, tokens: int = 0, codec: Codec = NONE,
                   indices: torch.Tensor | None = None) -> asyncio.Future:
        """Queue a step now (chain steps may carry no tensor: the peer's upstream pushes it); the future gets the
        step's output rows (``rows`` of them, or None with ``rows=0``: the output went downstream). With ``push``,
        a push into the next peer's session instead (``InferencePush``; the future gets None). ``codec`` (and
        ``indices``, top-k's forced pattern): how ``hidden`` travels."""
        future = asyncio.get_running_loop().create_future()
        if self.closed:
            future.set_exception(ConnectionError(f"stream to peer {short_id(self.peer_id)} is closed"))
            return future
        self._pending.append(_Step(session_id, position, hidden, timeout, future, rows, hold, push, tokens, codec,
                                   indices))
        self._schedule_flush()
        return future

    async def push(self, session_id: str, position: int, hidden: torch.Tensor, timeout: float, *,
                   codec: Codec = NONE, indices: torch.Tensor | None = None) -> None:
        """Push our outputs into a session of this (next) peer: the chain; may travel with other sessions' pushes
        (of the same codec; one with forced top-k ``indices`` travels alone)."""
        await self.queue_step(session_id, position, hidden, timeout, rows=0, push=True, codec=codec, indices=indices)

    def submit(self, message: Message, tensor: torch.Tensor | Encoded | None, timeout: float, *,
               observe: bool = True, codec: Codec = NONE, indices: torch.Tensor | None = None
               ) -> Awaitable[tuple[InferenceReply, torch.Tensor | None]]:
        """Queue one request at once (in the order of the calls, across streams too: the trainer sends each phase
        of a micro-batch to every stage this way) and return an awaitable of its reply; ``RequestError`` if it
        was refused. ``observe=False``: its timing is no link sample (a chained request's wall time includes other
        peers' work). ``codec``/``indices``: how ``tensor`` travels (an ``Encoded`` one travels as it is)."""
        coded = self.submit_coded(message, tensor, timeout, observe=observe, codec=codec, indices=indices)

        async def plain() -> tuple[InferenceReply, torch.Tensor | None]:
            reply, output, _ = await coded
            return reply, output

        return plain()

    def submit_coded(self, message: Message, tensor: torch.Tensor | Encoded | None, timeout: float, *,
                     observe: bool = True, codec: Codec = NONE, indices: torch.Tensor | None = None
                     ) -> Awaitable[tuple[InferenceReply, torch.Tensor | None, torch.Tensor | None]]:
        """``submit``, with the sorted flat indices of a top-k reply tensor (None for other codecs)."""
        future = self._send(pack_inference(message), tensor, timeout, observe=observe, codec=codec, indices=indices,
                            coded=True)

        async def checked() -> tuple[InferenceReply, torch.Tensor | None, torch.Tensor | None]:
            reply, output, kept = await future
            if reply.error:
                raise refusal_or_failure(f"peer {short_id(self.peer_id)} refused {type(message).__name__}: "
                                         f"{reply.error}", reply.failed_peer)
            return reply, output, kept

        return checked()

    def submit_bundle(self, message: Message, tensors: Mapping[str, torch.Tensor] | None, specs: Sequence[EdgeSpec],
                      reply_specs: Sequence[EdgeSpec], graph_hash: str, timeout: float, codec: Codec = NONE
                      ) -> Awaitable[tuple[InferenceReply, dict[str, torch.Tensor] | None]]:
        """Queue a request followed by an edge bundle of ``tensors`` (``specs``, checked here: ``ValueError``; its
        floating-point edges coded with ``codec``) and return an awaitable of its reply and the reply's bundle
        (``reply_specs``; None if the reply has none); ``RequestError`` if the peer refused it."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        messages = [_message(pack_inference(message))]
        if tensors is not None:
            messages += list(edge_messages(tensors, specs, graph_hash, seal=self._seal, codec=codec))
        if self.closed:
            future.set_exception(ConnectionError(f"stream to peer {short_id(self.peer_id)} is closed"))
        else:
            timer = loop.call_later(timeout, self._expire, future, timeout)
            if not self._waiting:
                self._idle_until = loop.time()
            self._waiting.append(_Due(future, timer, time.perf_counter(), bundle=(tuple(reply_specs), graph_hash)))
            for m in messages:
                self._outbox.put_nowait(m)

        async def checked() -> tuple[InferenceReply, dict[str, torch.Tensor] | None]:
            reply, output = await future
            if reply.error:
                raise RequestError(f"peer {short_id(self.peer_id)} refused {type(message).__name__}: {reply.error}")
            return reply, output

        return checked()

    def send_without_reply(self, message: Message) -> None:
        """A request that gets no reply (a relink); dropped if the stream is closed."""
        if not self.closed:
            self._outbox.put_nowait(_message(pack_inference(message)))

    def close_sessions(self, session_ids: list[str], *, detach: bool = False) -> None:
        """Free (or detach) sessions on the peer; no reply is awaited."""
        if not self.closed:
            self._outbox.put_nowait(_message(pack_inference(InferenceClose(session_ids=session_ids, detach=detach))))

    def shutdown(self, error: BaseException | None = None) -> None:
        """Fail everything pending and end the stream."""
        if self.closed:
            return
        self.closed = True
        error = error or ConnectionError(f"stream to peer {short_id(self.peer_id)} was closed")
        for step in self._pending:
            if not step.future.done():
                step.future.set_exception(error)
        self._pending.clear()
        while self._waiting:
            due = self._waiting.popleft()
            if due.timer is not None:
                due.timer.cancel()
            if not due.future.done():
                due.future.set_exception(error)
        self._outbox.put_nowait(None)  # the writer sends the end of stream, then closes
        for task in (self._reader, self._watchdog):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        if self._replies is not None:
            self._replies.close()

    # ---- internals --------------------------------------------------------------------------------
    def _schedule_flush(self) -> None:
        if not self._flush_scheduled and not self._in_flight:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Send the pending steps that can travel together, unless a step is already in flight."""
        self._flush_scheduled = False
        if self._in_flight or self.closed or not self._pending:
            return
        kind = self._pending[0].group
        group, rest, size, ids = [], [], 0, set()
        for step in self._pending:
            step_tokens = 1 if step.hidden is None else step.hidden.shape[0] * step.hidden.shape[1]
            # a session's steps travel one per message, in order (a replay queued next to the step that follows it)
            if not group or (step.group == kind and step.session_id not in ids
                             and size + step_tokens <= MAX_COALESCED_TOKENS):
                group.append(step)
                ids.add(step.session_id)
                size += step_tokens
            else:
                rest.append(step)
        self._pending = rest
        ids, positions = [s.session_id for s in group], [s.position for s in group]
        tensors = [s.hidden for s in group if s.hidden is not None]
        message = (InferencePush(session_ids=ids, positions=positions, rows=[len(t) for t in tensors])
                   if group[0].push else InferenceStep(session_ids=ids, positions=positions, hold=group[0].hold))
        hidden = None if not tensors else torch.cat(tensors) if len(tensors) > 1 else tensors[0]
        self._in_flight = True
        self.step_messages += 1
        reply = self._send(pack_inference(message), hidden, max(s.timeout for s in group), codec=group[0].codec,
                           indices=group[0].indices)
        reply.add_done_callback(lambda done: self._deliver(done, group))

    def _deliver(self, done: asyncio.Future, group: list[_Step]) -> None:
        self._in_flight = False
        if done.cancelled() or done.exception() is not None:
            error = ConnectionError("request cancelled") if done.cancelled() else done.exception()
            for step in group:
                if not step.future.done():
                    step.future.set_exception(error)
        else:
            reply, output = done.result()[:2]
            what = "a push" if group[0].push else "a step"
            accepted = [s for s, e in zip(group, reply.errors, strict=False) if not e and s.rows]
            rows = sum(s.rows for s in accepted)
            if reply.error or len(reply.errors) != len(group) or (output.shape[0] if output is not None else 0) != rows:
                why = reply.error or "malformed reply"
                error = refusal_or_failure(f"peer {short_id(self.peer_id)} refused {what}: {why}", reply.failed_peer)
                for step in group:
                    if not step.future.done():
                        step.future.set_exception(error)
            else:
                outputs = iter(output.split([s.rows for s in accepted]) if accepted and output is not None else ())
                for step, message in zip(group, reply.errors, strict=True):
                    if step.future.done():
                        continue
                    if message:
                        refusal = f"peer {short_id(self.peer_id)} refused {what}: {message}"
                        step.future.set_exception(refusal_or_failure(refusal, reply.failed_peer))
                    else:
                        step.future.set_result(next(outputs) if step.rows else None)
        self._schedule_flush()

    async def _request(self, metadata: bytes, hidden: torch.Tensor | None, timeout: float, *, observe: bool = True,
                       codec: Codec = NONE):
        """Send one request and wait for its reply ``(InferenceReply, tensor or None)``."""
        return await self._send(metadata, hidden, timeout, observe=observe, codec=codec)

    def _send(self, metadata: bytes, hidden: torch.Tensor | Encoded | None, timeout: float, *, observe: bool = True,
              codec: Codec = NONE, indices: torch.Tensor | None = None, coded: bool = False) -> asyncio.Future:
        """Queue one request now (``hidden`` in ``codec``); the future of its reply ``(InferenceReply, tensor or
        None)``, with ``coded`` ``(InferenceReply, tensor or None, top-k indices or None)``."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if self.closed:
            future.set_exception(ConnectionError(f"stream to peer {short_id(self.peer_id)} is closed"))
            return future
        timer = loop.call_later(timeout, self._expire, future, timeout)
        alone = not self._waiting
        if alone:
            self._idle_until = loop.time()  # silence before this request does not count against the peer
        messages = [_message(metadata)] if hidden is None else list(
            tensor_messages(hidden, metadata, seal=self._seal, codec=codec, indices=indices))
        sent = sum(m.ByteSize() for m in messages) if alone and observe and self.observe is not None else None
        self._waiting.append(_Due(future, timer, time.perf_counter(), sent, coded))
        for message in messages:
            self._outbox.put_nowait(message)
        return future

    @property
    def encrypted(self) -> bool:
        return self._channel is not None

    @property
    def _seal(self):
        return sealer(self._channel)

    @property
    def _unseal(self):
        return unsealer(self._channel)

    def _expire(self, future: asyncio.Future, timeout: float) -> None:
        if not future.done():
            self.shutdown(TimeoutError(f"peer {short_id(self.peer_id)} did not answer within {timeout:.1f} s"))

    async def _write(self, out: FrameWriter) -> None:
        """Send the outbox's messages in order; at its end (``shutdown``), hivemind's end-of-stream frame."""
        try:
            while (message := await self._outbox.get()) is not None:
                self.bytes_sent += message.ByteSize()
                await out.send(encode(message))
                # the peer cannot answer what it has not got: silence counts from our last write (a request
                # queued behind our own bulk data is not the peer's delay)
                self._idle_until = asyncio.get_running_loop().time()
            await out.send(end_of_stream())
        except (ConnectionError, OSError) as e:
            self.shutdown(ConnectionError(f"stream to peer {short_id(self.peer_id)} broke while sending: {e!r}"))
        finally:
            if self.closed:  # after a shutdown; an end of stream alone only half-closes (replies may still come)
                out.close()

    async def _frames(self):
        """The peer's replies, without its heartbeats."""
        while (message := await self._replies.get()) is not None:
            self.bytes_received += message.ByteSize()
            if message.tensors or message.metadata != HEARTBEAT_METADATA:
                yield message

    async def _watch(self, limit: float) -> None:
        """Fail the pending requests once the peer has sent nothing (no reply, no heartbeat) for ``limit`` s."""
        loop = asyncio.get_running_loop()
        while not self.closed:
            before = loop.time()
            await asyncio.sleep(limit / 4)
            if loop.time() - before > limit / 2:  # our own loop was blocked: frames may be waiting unread
                continue
            heard = max(self._replies.last_frame, self._idle_until, activity.last_heard(self.peer_id))
            if self._waiting and loop.time() - heard > limit:
                self.shutdown(ConnectionError(
                    f"peer {short_id(self.peer_id)} sent nothing for {loop.time() - heard:.1f} s (no reply, no "
                    f"heartbeat) while requests were pending: it is gone or unreachable"))

    async def _read(self, replies) -> None:
        try:
            async for first in replies:
                output = kept = None
                before = self.bytes_received - first.ByteSize()
                expects = self._waiting[0].bundle if self._waiting else None
                if first.tensors and expects is not None:  # an edge bundle; the reply is its context
                    output, context = await read_edge_messages(replies, expects[0], expects[1], MAX_REPLY_BYTES,
                                                               first=first, unseal=self._unseal)
                    reply = InferenceReply.from_bytes(context)
                else:
                    reply = InferenceReply.from_bytes(first.metadata)
                if first.tensors and expects is None:
                    _, output, kept = await read_coded_messages(replies, MAX_REPLY_BYTES, first=first,
                                                                unseal=self._unseal)
                if not self._waiting:
                    raise ConnectionError("the peer sent a reply nobody asked for")
                due = self._waiting.popleft()
                if due.timer is not None:
                    due.timer.cancel()
                self._sample(due, reply, self.bytes_received - before)
                if not due.future.done():
                    due.future.set_result((reply, output, kept) if due.coded else (reply, output))
            end = self._replies.end.error if self._replies.end is not None else ""
            reason = f"peer {short_id(self.peer_id)} closed the stream"
            self.shutdown(ConnectionError(f"{reason}: {end}" if end else reason))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            broke = ConnectionError(f"stream to peer {short_id(self.peer_id)} closed or broke: {e!r}")
            self.shutdown(e if isinstance(e, RequestError) else broke)
        finally:
            if self._writer is None or self._writer.done():
                self._out.close()


    def _sample(self, due: _Due, reply: InferenceReply, received: int) -> None:
        """Tell ``observe`` the timing of a reply that reports the peer's time on it (a passive link sample);
        ``received``: the reply's bytes on the wire (coded, sealed)."""
        if due.sent is None or self.observe is None or reply.error or not reply.compute_ms > 0:
            return
        wall = time.perf_counter() - due.began
        try:
            self.observe(self.peer_id, wall, reply.compute_ms / 1e3, due.sent + received)
        except Exception as e:  # a measurement must never break the stream
            logger.debug("Link observer failed: %r", e)


def _message(metadata: bytes) -> runtime_pb2.ExpertRequest:
    return runtime_pb2.ExpertRequest(metadata=metadata)

