"""Server-side inference sessions: each holds the KV cache of its blocks, within a peer's cache budget.

The budget is shared between clients (the peer ids that own sessions). A client may always use up to its share
(``client_share`` of ``cache_tokens``); beyond it, it borrows: only while no other client is waiting for space
within its own share, nor was turned away for lack of it in the last ``timeout`` seconds (it will retry soon, and
the space it is owed must not be taken again meanwhile). An open that cannot be admitted waits in a FIFO queue up
to ``cache_wait`` seconds for space that closes and reaping free, then is refused with a ``CapacityError`` (its
message starts with ``CAPACITY_REFUSAL``). Admitted sessions are never evicted: one can always grow to its
``max_length``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from peers.core.chunks import first_tokens
from peers.model import KV
from peers.model.adapters import Active
from peers.wire.errors import CAPACITY_REFUSAL, CapacityError, RequestError
from peers.wire.messages import InferenceOpen

logger = logging.getLogger(__name__)

MAX_PEER_ID_CHARS = 128  # base58 peer ids are ~52 characters


@dataclass
class Session:
    """One client's generation state on this peer."""

    session_id: str
    owner: str  # peer id of the client that opened it
    start: int
    end: int
    max_length: int
    batch_size: int
    past: list[KV] | None = None  # per block, each [batch, kv_heads, length, head_dim]
    length: int = 0  # tokens in the cache
    attached: bool = True  # a stream is using it now
    last_used: float = field(default_factory=time.monotonic)
    # the chain (``peers.server.chain_calls``): who pushes our inputs and where our outputs go ("": the client)
    upstream: str = ""
    downstream: str = ""
    downstream_session: str = ""
    kept: list[torch.Tensor] = field(default_factory=list, repr=False)  # outputs sent downstream, for a replay
    order: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)  # chain steps of this session, in turn
    moved: str = ""  # the peer moved to another span: its later steps get this refusal (``moved: ...``)
    compression: str = ""  # the codec of its outputs, to the client and downstream (``InferenceOpen.compression``)
    adapter: Active | None = field(default=None, repr=False)  # the LoRA it runs with (this session only)

    @property
    def reserved_tokens(self) -> int:
        return self.max_length * self.batch_size

    @property
    def chained(self) -> bool:
        return bool(self.upstream or self.downstream)

    def truncate(self, position: int) -> None:
        """Roll the cache back to its first ``position`` tokens (a step the client re-sends)."""
        if position < self.length:
            self.past = None if position == 0 else [(k[:, :, :position], v[:, :, :position]) for k, v in self.past]
            self.length = position
        self.kept = first_tokens(self.kept, position)

    def keep(self, position: int, output: torch.Tensor) -> None:
        """Remember the outputs of tokens ``[position, position + T)`` (sent downstream) for a replay."""
        self.kept = first_tokens(self.kept, position)
        if sum(x.shape[1] for x in self.kept) == position:
            self.kept.append(output)

    def kept_outputs(self, upto: int) -> torch.Tensor | None:
        """The outputs kept for tokens ``[0, upto)``, or None if we do not hold them all."""
        kept = first_tokens(self.kept, upto)
        if sum(x.shape[1] for x in kept) != upto or not kept:
            return None
        return torch.cat(kept, dim=1)



@dataclass(eq=False)
class _Waiter:
    """An open waiting for cache space; ``granted`` gets its new session."""

    request: InferenceOpen
    owner: str
    granted: asyncio.Future = field(repr=False)

    @property
    def wanted(self) -> int:
        return self.request.max_length * self.request.batch_size


class SessionRegistry:
    """Opens, resumes, closes and reaps sessions within ``cache_tokens``, shared fairly between clients.

    The budget counts batch rows x ``max_length`` reserved at open, so a session that was admitted can always
    grow to its maximum length.
    """

    def __init__(self, *, cache_tokens: int, timeout: float, max_length_limit: int, client_share: float = 0.5,
                 cache_wait: float = 2.0) -> None:
        if cache_tokens <= 0 or timeout <= 0:
            raise ValueError("cache_tokens and session timeout must be positive")
        if not 0 < client_share <= 1 or cache_wait < 0:
            raise ValueError("client_share must be in (0, 1] and cache_wait >= 0")
        self.cache_tokens, self.timeout, self.max_length_limit = cache_tokens, timeout, max_length_limit
        self.share_tokens = max(1, math.floor(cache_tokens * client_share))  # what a client may always use
        self.cache_wait = cache_wait
        self.sessions: dict[str, Session] = {}
        self._queue: list[_Waiter] = []  # opens waiting for space, first come first served
        self._refused: dict[str, float] = {}  # owner -> when an open within its share was last refused for space
        self.on_close: list[Callable[[str], None]] = []  # told each freed session id (the chain drops its pushes)
        self.moved: dict[str, str] = {}  # sessions of the span this peer left -> their refusal (``moved: ...``)

    @property
    def tokens_used(self) -> int:
        return sum(s.reserved_tokens for s in self.sessions.values())

    @property
    def tokens_free(self) -> int:
        return self.cache_tokens - self.tokens_used

    @property
    def opens_waiting(self) -> int:
        return sum(1 for w in self._queue if not w.granted.done())

    def held_by(self, owner: str) -> int:
        """Cache tokens reserved by ``owner``'s sessions."""
        return sum(s.reserved_tokens for s in self.sessions.values() if s.owner == owner)

    def attached_count(self) -> int:
        """Sessions with a live stream: how many steps may arrive together."""
        return sum(1 for s in self.sessions.values() if s.attached)

    async def open(self, request: InferenceOpen, owner: str, served: tuple[int, int], *,
                   wait: float | None = None) -> Session:
        """A new session (waiting up to ``wait``, default ``cache_wait``, s for space), or the caller's detached
        session if ``request.resume``; ``CapacityError`` if there is no room for it, ``RequestError`` otherwise."""
        self.reap()
        existing = self._check(request, owner, served)
        if existing is not None:
            return existing
        waiter = _Waiter(request, owner, asyncio.get_running_loop().create_future())
        self._queue.append(waiter)
        try:
            self._grant()
            give_up = time.monotonic() + (self.cache_wait if wait is None else wait)
            while not waiter.granted.done():
                remaining = give_up - time.monotonic()
                if remaining <= 0:
                    raise self._refusal(waiter)
                # wake when the next session may expire, to reap it even if the server's reaper runs later
                await asyncio.wait([waiter.granted], timeout=min(remaining, self._next_expiry()))
                self.reap()
            return waiter.granted.result()
        except BaseException:
            if waiter.granted.done() and not waiter.granted.cancelled():  # granted, but the caller went away
                self.close(waiter.granted.result().session_id)
            raise
        finally:
            if waiter in self._queue:
                self._queue.remove(waiter)
                self._grant()  # the opens it held back may fit now

    def close(self, session_id: str) -> None:
        """Free a session's cache now (and hand the space to waiting opens)."""
        if self.sessions.pop(session_id, None) is not None:
            for hook in self.on_close:
                hook(session_id)
            self._grant()

    def detach(self, session_id: str) -> None:
        """Its stream broke: keep the cache for ``timeout`` seconds so that the client may resume."""
        session = self.sessions.get(session_id)
        if session is not None:
            session.attached, session.last_used = False, time.monotonic()

    def reap(self) -> list[str]:
        """Free sessions unused for longer than ``timeout`` (idle, or detached and never resumed)."""
        now = time.monotonic()
        expired = [s.session_id for s in self.sessions.values() if now - s.last_used > self.timeout]
        for session_id in expired:
            logger.info("Freed idle session %s", session_id)
            self.close(session_id)
        for owner in [o for o, t in self._refused.items() if now - t >= self.timeout]:
            del self._refused[owner]
        return expired

    # ---- internals --------------------------------------------------------------------------------
    def _check(self, request: InferenceOpen, owner: str, served: tuple[int, int]) -> Session | None:
        """Validate an open: the resumed session, None for a valid new one, ``RequestError`` otherwise."""
        existing = self.sessions.get(request.session_id)
        if request.resume:
            if existing is None:
                raise RequestError(
                    f"unknown session id {request.session_id!r} (expired or never opened): open a new one"
                )
            if existing.owner != owner:
                raise RequestError(f"session {request.session_id!r} belongs to another client")
            if existing.attached:
                raise RequestError(f"session {request.session_id!r} is in use by another stream")
            existing.attached, existing.last_used = True, time.monotonic()
            return existing
        if existing is None:
            existing = next((w for w in self._queue if w.request.session_id == request.session_id), None)
        if existing is not None:
            who = "you" if existing.owner == owner else "another client"
            raise RequestError(f"session id {request.session_id!r} is already used by {who}; pick a fresh random id")
        if not 1 <= len(request.session_id) <= 64:
            raise RequestError("session id must have 1..64 characters")
        if not served[0] <= request.start < request.end <= served[1]:
            raise RequestError(f"this peer serves blocks {served[0]}:{served[1]}, not {request.start}:{request.end}")
        if not 1 <= request.max_length <= self.max_length_limit:
            raise RequestError(f"max_length must be in 1..{self.max_length_limit}, got {request.max_length}")
        if request.batch_size < 1:
            raise RequestError("batch_size must be >= 1")
        if max(len(request.upstream), len(request.downstream)) > MAX_PEER_ID_CHARS or (
                bool(request.downstream) != bool(request.downstream_session)) or len(request.downstream_session) > 64:
            raise RequestError("upstream and downstream must be peer ids (or empty), and a downstream needs its "
                               "downstream_session (1..64 characters)")
        if owner in (request.upstream, request.downstream):
            raise RequestError("a session's upstream or downstream is another peer, or empty for the client itself")
        wanted = request.max_length * request.batch_size
        if wanted > self.cache_tokens:
            raise RequestError(f"this session needs {wanted} token slots but this peer's whole cache has "
                               f"{self.cache_tokens}; use a shorter max_length or another peer")
        return None

    def _borrowing(self, waiter: _Waiter) -> bool:
        """Would this open take its client beyond its share?"""
        return self.held_by(waiter.owner) + waiter.wanted > self.share_tokens

    def _contended(self, owner: str) -> bool:
        """Does another client wait (or did it recently fail) for space within its share?"""
        if any(w.owner != owner and not w.granted.done() and not self._borrowing(w) for w in self._queue):
            return True
        now = time.monotonic()
        return any(o != owner and now - t < self.timeout for o, t in self._refused.items())

    def _held_back_by_share(self, waiter: _Waiter) -> bool:
        return self._borrowing(waiter) and self._contended(waiter.owner)

    def _grant(self) -> None:
        """Admit waiting opens in FIFO order while they fit.

        One held back by space holds back those behind it (first come, first served); a borrower (beyond its
        share) never does, and is skipped while another client is owed space.
        """
        free = self.tokens_free
        for waiter in list(self._queue):
            if waiter.granted.done() or self._held_back_by_share(waiter):
                continue
            if waiter.wanted > free:
                if self._borrowing(waiter):
                    continue
                break
            self._queue.remove(waiter)
            request = waiter.request
            session = Session(request.session_id, waiter.owner, request.start, request.end, request.max_length,
                              request.batch_size, upstream=request.upstream, downstream=request.downstream,
                              downstream_session=request.downstream_session, compression=request.compression)
            self.sessions[session.session_id] = session
            self._refused.pop(waiter.owner, None)
            waiter.granted.set_result(session)
            free -= waiter.wanted

    def _next_expiry(self) -> float:
        """Seconds until the least recently used session may be reaped (at least 50 ms)."""
        if not self.sessions:
            return math.inf
        oldest = min(s.last_used for s in self.sessions.values())
        return max(0.05, oldest + self.timeout - time.monotonic())

    def _refusal(self, waiter: _Waiter) -> CapacityError:
        """Why ``waiter`` (still queued) was not admitted in time; remembers an entitled client's refusal."""
        held, wanted, total = self.held_by(waiter.owner), waiter.wanted, self.cache_tokens
        if self._held_back_by_share(waiter):
            return CapacityError(
                f"{CAPACITY_REFUSAL} this client already holds {held} of {total} cache tokens (its share is "
                f"{self.share_tokens}) and this session needs {wanted} more while other clients wait for space; "
                "close a session, retry later or use another peer"
            )
        if not self._borrowing(waiter):
            self._refused[waiter.owner] = time.monotonic()
        free = self.tokens_free
        if wanted <= free:
            ahead = [w for w in self._queue[: self._queue.index(waiter)] if not self._borrowing(w)]
            detail = f"{free} of {total} token slots are free but {len(ahead)} earlier opens wait for them"
        else:
            detail = f"this session needs {wanted} token slots but {free} of {total} are free{self._eta(wanted)}"
        return CapacityError(f"{CAPACITY_REFUSAL} cache full: {detail}; retry later or use another peer")

    def _eta(self, wanted: int) -> str:
        """When enough space frees if the least recently used sessions stay idle until they are reaped."""
        missing, now = wanted - self.tokens_free, time.monotonic()
        for session in sorted(self.sessions.values(), key=lambda s: s.last_used):
            missing -= session.reserved_tokens
            if missing <= 0:
                return f" (if sessions stay idle, enough is free in ~{session.last_used + self.timeout - now:.0f} s)"
        return ""
