"""Server-side inference sessions: each holds the KV cache of its blocks, within a peer's cache budget."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from peers.model import KV
from peers.protocol import InferenceOpen, RequestError

logger = logging.getLogger(__name__)


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

    @property
    def reserved_tokens(self) -> int:
        return self.max_length * self.batch_size

    def truncate(self, position: int) -> None:
        """Roll the cache back to its first ``position`` tokens (a step the client re-sends)."""
        if position < self.length:
            self.past = None if position == 0 else [(k[:, :, :position], v[:, :, :position]) for k, v in self.past]
            self.length = position


class SessionRegistry:
    """Opens, resumes, closes and reaps sessions; refuses those that do not fit ``cache_tokens``.

    The budget counts batch rows x ``max_length`` reserved at open, so a session that was admitted can
    always grow to its maximum length.
    """

    def __init__(self, *, cache_tokens: int, timeout: float, max_length_limit: int) -> None:
        if cache_tokens <= 0 or timeout <= 0:
            raise ValueError("cache_tokens and session timeout must be positive")
        self.cache_tokens, self.timeout, self.max_length_limit = cache_tokens, timeout, max_length_limit
        self.sessions: dict[str, Session] = {}

    @property
    def tokens_used(self) -> int:
        return sum(s.reserved_tokens for s in self.sessions.values())

    def attached_count(self) -> int:
        """Sessions with a live stream: how many steps may arrive together."""
        return sum(1 for s in self.sessions.values() if s.attached)

    @property
    def tokens_free(self) -> int:
        return self.cache_tokens - self.tokens_used

    def open(self, request: InferenceOpen, owner: str, served: tuple[int, int]) -> Session:
        """A new session, or the caller's detached session if ``request.resume``; ``RequestError`` otherwise."""
        self.reap()
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
        wanted = request.max_length * request.batch_size
        if wanted > self.tokens_free:
            raise RequestError(
                f"cache full: this session needs {wanted} token slots but {self.tokens_free} of "
                f"{self.cache_tokens} are free; use another peer or retry later"
            )
        session = Session(request.session_id, owner, request.start, request.end, request.max_length,
                          request.batch_size)
        self.sessions[session.session_id] = session
        return session

    def close(self, session_id: str) -> None:
        """Free a session's cache now."""
        self.sessions.pop(session_id, None)

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
        return expired
