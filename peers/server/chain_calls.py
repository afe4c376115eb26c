"""The chain's side of a peer's stream: steps of sessions whose input comes from the previous peer or whose output
goes to the next one, the pushes between peers, and the client's re-routing around a failed peer.

A session opened with an ``upstream`` takes its inputs as pushes (``InferencePush``) from that peer only; the
client's step for it carries no tensor and says "your input comes from your upstream" (the step is deferred: the
stream goes on with the client's next requests while it waits). A session with a ``downstream`` pushes its outputs
to that peer's session and keeps them, so that the client can have them replayed into a replacement of a failed
next peer (``InferenceReplay``); its step reply carries no tensor, and says which peer failed (``failed_peer``)
when the push did not go through. Pushes are acked at once; they never wait for anything, so that waits depend
only on pushes from other peers, in block order: no deadlock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import torch
from hivemind.p2p import P2PDaemonError, P2PHandlerError
from hivemind.proto import runtime_pb2

from peers.core.aio import deadline
from peers.server.backend import StageBackend
from peers.server.calls import (
    Call,
    Deferred,
    Responses,
    StreamCalls,
    codec_of,
    defer,
    elapsed_ms,
    reply,
    tensor_reply,
)
from peers.server.inbox import Inbox
from peers.server.kv_sessions import Session, SessionRegistry
from peers.wire.errors import MovedError, RequestError
from peers.wire.messages import (
    InferencePush,
    InferenceRelink,
    InferenceReplay,
    InferenceReply,
    InferenceStep,
    StageInfo,
)
from peers.wire.stream import PeerStream
from privacy.peer_ids import short_id

logger = logging.getLogger(__name__)

StreamFor = Callable[[str], Awaitable[PeerStream]]  # this peer's stream to another (``PeerLinks.get``)
CONNECT_TIMEOUT = 5.0  # seconds to open a stream to the next peer
PUSH_FAILURES = (ConnectionError, TimeoutError, asyncio.TimeoutError, OSError, RequestError, P2PDaemonError,
                 P2PHandlerError, ValueError)


class ChainCalls(StreamCalls):
    """Chained steps, pushes, relinks and replays of the sessions in ``sessions``."""

    def __init__(self, backend: StageBackend, sessions: SessionRegistry, info: StageInfo, *,
                 check_hidden: Callable[..., None], request_timeout: float, require_encryption: bool,
                 stream_for: StreamFor | None, inbox: Inbox | None = None) -> None:
        super().__init__(info, request_timeout=request_timeout, require_encryption=require_encryption)
        self.backend, self.sessions, self.check_hidden, self.stream_for = backend, sessions, check_hidden, stream_for
        self.inbox = inbox or Inbox(max_bytes=max(4 * info.max_request_bytes, 64 << 20), ttl=2 * request_timeout)
        sessions.on_close.append(self._closed)

    def check_open(self, upstream: str, downstream: str) -> None:
        """Refuse a chained session this peer cannot serve."""
        if self.info.peer_id in (upstream, downstream):
            raise RequestError("a session's upstream and downstream are other peers (or empty for the client)")
        if downstream and self.stream_for is None:
            raise RequestError("this peer cannot reach other peers: open the session without a downstream")

    # ---- the client's steps --------------------------------------------------------------------
    def steps(self, request: InferenceStep, call: Call, sessions: list[Session], hidden: torch.Tensor | None
              ) -> Deferred:
        """Check what the step carries against its sessions, then run it deferred (it may wait for pushes)."""
        from_client = [s for s in sessions if not s.upstream]
        if from_client and hidden is None:
            raise RequestError(f"session {from_client[0].session_id!r} takes its input from you (no upstream was "
                               "named at open): the step must carry it")
        if not from_client and hidden is not None:
            raise RequestError("these sessions take their input from their upstream peer: send the step without "
                               "a tensor")
        given: list[torch.Tensor | None] = [None] * len(sessions)
        if hidden is not None:
            rows = [s.batch_size for s in from_client]
            self.check_hidden(hidden, max_rows=sum(rows))
            if hidden.shape[0] != sum(rows):
                raise RequestError(f"the sessions that take their input from you have {sum(rows)} rows in all, "
                                   f"got {hidden.shape[0]}")
            parts = iter(hidden.split(rows))
            given = [None if s.upstream else next(parts) for s in sessions]
        return defer(self._steps(request, call, sessions, given), "step")

    async def _steps(self, request: InferenceStep, call: Call, sessions: list[Session],
                     given: list[torch.Tensor | None]) -> Responses:
        async with contextlib.AsyncExitStack() as held:
            for session in sorted({s.session_id: s for s in sessions}.values(), key=lambda s: s.session_id):
                await held.enter_async_context(session.order)
            inputs = await asyncio.gather(*(self._input(s, p, x) for s, p, x in
                                            zip(sessions, request.positions, given, strict=True)),
                                          return_exceptions=True)
            errors, runs = [], []
            for session, position, x in zip(sessions, request.positions, inputs, strict=True):
                try:
                    if isinstance(x, BaseException):
                        raise x
                    if self.sessions.sessions.get(session.session_id) is not session:
                        raise RequestError(f"session {session.session_id!r} was closed")
                    if x.shape[0] != session.batch_size:
                        raise RequestError(f"session {session.session_id!r} has {session.batch_size} rows, its "
                                           f"input {x.shape[0]}")
                    self.check_hidden(x, max_rows=session.batch_size)
                    check_step(session, x, position)
                except (RequestError, ValueError) as e:
                    errors.append(str(e))
                    continue
                errors.append("")
                session.last_used = time.monotonic()
                runs.append((len(errors) - 1, session, position, self.backend.inference_step(session, x, position)))
            async with deadline(self.request_timeout):
                outputs = await asyncio.gather(*(run for *_, run in runs))
            pushes = []
            for (index, session, position, _), output in zip(runs, outputs, strict=True):
                if session.downstream:
                    session.keep(position, output)
                    if not request.hold:  # (the next peer now: a relink may replace it while the push runs)
                        pushes.append((index, session, session.downstream,
                                       self._push(session, session.downstream, session.downstream_session, position,
                                                  output)))
            results = await asyncio.gather(*(push for *_, push in pushes), return_exceptions=True)
        failed_peer = ""
        for (index, session, target, _), result in zip(pushes, results, strict=True):
            if isinstance(result, BaseException):  # name the peer the push went to, not its replacement
                errors[index] = (f"could not hand the output of session {session.session_id!r} to the next peer "
                                 f"{short_id(target)}: {result}")
                failed_peer = failed_peer or target
                logger.info("Chain: %s", errors[index])
        returned = [(session, output) for (index, session, _, _), output in zip(runs, outputs, strict=True)
                    if not session.downstream and not request.hold and not errors[index]]
        back = [output for _, output in returned]
        # no compute_ms: the client's wall time on a chained step includes other peers' work and pushes, so it is no
        # sample of its link to us (pushes' acks measure the links between peers)
        metadata = InferenceReply(errors=errors, failed_peer=failed_peer)
        if not back:
            return [runtime_pb2.ExpertResponse(metadata=metadata.to_bytes())]
        return tensor_reply(torch.cat(back) if len(back) > 1 else back[0], metadata, call.stream,
                            codec=codec_of([s.compression for s, _ in returned]))

    async def _input(self, session: Session, position: int, given: torch.Tensor | None) -> torch.Tensor:
        if given is not None:
            return given
        what = (f"the input of session {session.session_id!r} at token {position} from its upstream peer "
                f"{short_id(session.upstream)}")
        if self.sessions.sessions.get(session.session_id) is not session:
            # closed before this step got here (its close failed no waiter): do not hold the stream's replies
            raise RequestError(f"session {session.session_id!r} was closed")
        return await self.inbox.take((session.session_id, position), self.request_timeout, what)

    async def _push(self, session: Session, target: str, target_session: str, position: int, output: torch.Tensor
                    ) -> None:
        """``output`` to session ``target_session`` on peer ``target`` (the session's next peer when the step ran)."""
        if self.stream_for is None:
            raise RequestError("this peer cannot reach other peers")
        try:  # a next peer that died is not dialed for long: the client waits to hear which peer failed
            stream = await asyncio.wait_for(self.stream_for(target), CONNECT_TIMEOUT)
        except asyncio.TimeoutError:
            raise ConnectionError(f"could not reach it within {CONNECT_TIMEOUT:.0f} s") from None
        await stream.push(target_session, position, output, self.request_timeout,
                          codec=codec_of([session.compression]))

    # ---- pushes from the previous peer ---------------------------------------------------------
    async def push(self, request: InferencePush, call: Call) -> Responses:
        """Take a previous peer's outputs into our sessions' inboxes (only from each session's named upstream)."""
        try:
            hidden = await self.read_tensor(call)
            started = time.perf_counter()
            ids, positions, rows = request.session_ids, request.positions, request.rows
            if not ids or not len(ids) == len(positions) == len(rows) or len(set(ids)) != len(ids):
                raise RequestError("a push needs distinct session_ids, one position and one row count for each")
            if min(rows) < 1 or sum(rows) != hidden.shape[0]:
                raise RequestError(f"the push's rows {rows} do not add up to its tensor's {hidden.shape[0]}")
            self.check_hidden(hidden, max_rows=max(sum(rows), self.info.max_batch_size))
        except (RequestError, ValueError, asyncio.TimeoutError) as e:
            logger.info("Refused a push from %s: %s", short_id(call.caller), e)
            return [reply(error=str(e) or "the push exceeded its deadline")]
        errors = [self._accept(call.caller, *part) for part in zip(ids, positions, hidden.split(rows), strict=True)]
        return [runtime_pb2.ExpertResponse(metadata=InferenceReply(errors=errors,
                                                                   compute_ms=elapsed_ms(started)).to_bytes())]

    def _accept(self, pusher: str, session_id: str, position: int, part: torch.Tensor) -> str:
        session = self.sessions.sessions.get(session_id)
        if session is None:
            if moved := self.sessions.moved.get(session_id):
                return moved
            return f"session {session_id!r} is not open on this peer (closed, expired or never opened)"
        if session.upstream != pusher:
            named = f"peer {short_id(session.upstream)}" if session.upstream else "itself"
            logger.info("Refused a push into session %s from %s: its client named %s", session_id, short_id(pusher),
                        named)
            return (f"peer {short_id(pusher)} is not the upstream of session {session_id!r}: its client named "
                    f"{named}, and this peer takes pushes into a session from nobody else")
        try:
            if part.shape[0] != session.batch_size:
                raise RequestError(f"session {session_id!r} has {session.batch_size} rows, the push {part.shape[0]}")
            check_step(session, part, position)
            self.inbox.put((session_id, position), part)
        except RequestError as e:
            return str(e)
        return ""

    def retire(self, refusal: str) -> None:
        """This peer moved off our span: every step still waiting for a push gets ``refusal`` now (a step already
        computing finishes)."""
        self.inbox.fail(lambda key: True, refusal)

    def _closed(self, session_id: str) -> None:
        self.inbox.fail(lambda key: key[0] == session_id, f"session {session_id!r} was closed")

    # ---- the client's re-routing ---------------------------------------------------------------
    async def relink(self, request: InferenceRelink, call: Call) -> Responses:
        """Change a session's upstream and/or downstream (a re-route around a failed peer); no reply."""
        session = call.stream.owned.get(request.session_id)
        if session is None or self.sessions.sessions.get(request.session_id) is not session:
            logger.info("Relink of a session not open on this stream (%r): ignored", request.session_id)
            return []
        try:
            if request.set_upstream:
                self.check_open(request.upstream, "")
            if request.set_downstream:
                self.check_open("", request.downstream)
                if not request.downstream_session and request.downstream:
                    raise RequestError("a downstream needs its downstream_session")
        except RequestError as e:
            logger.info("Relink of session %s refused: %s", request.session_id, e)
            return []
        if request.set_upstream and request.upstream != session.upstream:
            session.upstream = request.upstream
            self.inbox.drop_untaken(lambda key: key[0] == session.session_id)  # pushed by the one we leave
        if request.set_downstream:
            session.downstream, session.downstream_session = request.downstream, request.downstream_session
        return []

    async def replay(self, request: InferenceReplay, call: Call) -> Responses | Deferred:
        """Push the outputs we kept for tokens ``[0, upto)`` into a replacement of our failed next peer, which
        becomes the session's downstream."""
        session = call.stream.owned.get(request.session_id)
        try:
            if session is not None and session.moved:
                raise MovedError(session.moved)
            if session is None or self.sessions.sessions.get(request.session_id) is not session:
                raise RequestError(f"session {request.session_id!r} is not open on this stream")
            if not request.downstream or not 1 <= len(request.downstream_session) <= 64:
                raise RequestError("a replay needs the new downstream peer and its session id")
            self.check_open("", request.downstream)
            if not 0 <= request.upto <= session.length:
                raise RequestError(f"replay up to token {request.upto}, but the session holds {session.length}")
        except RequestError as e:
            return [reply(error=str(e))]
        return defer(self._replay(session, request), "replay")

    async def _replay(self, session: Session, request: InferenceReplay) -> Responses:
        """Not in turn with the session's steps: one may still be trying to push to the failed peer, and the tokens
        replayed (before the client's position) are kept already and never change under a step at that position."""
        session.downstream, session.downstream_session = request.downstream, request.downstream_session
        if request.upto == 0:
            return [reply()]
        kept = session.kept_outputs(request.upto)
        if kept is None:
            return [reply(error=f"this peer has not kept the outputs of tokens 0:{request.upto} of session "
                                f"{session.session_id!r} (it had no downstream then)")]
        try:
            await self._push(session, request.downstream, request.downstream_session, 0, kept)
        except PUSH_FAILURES as e:
            error = f"could not replay session {session.session_id!r} into peer {short_id(request.downstream)}: {e}"
            return [runtime_pb2.ExpertResponse(metadata=InferenceReply(
                error=error, failed_peer=request.downstream).to_bytes())]
        return [reply()]


def check_step(session: Session, part: torch.Tensor, position: int) -> None:
    """A step of ``part``'s tokens at ``position`` fits the session (at most its length: a lower one rolls back)."""
    if not 0 <= position <= session.length:
        raise RequestError(f"step starts at token {position} but the session holds {session.length}")
    if position + part.shape[1] > session.max_length:
        raise RequestError(
            f"step would reach {position + part.shape[1]} tokens, beyond the session's max_length "
            f"{session.max_length}; open a session with a larger max_length"
        )
