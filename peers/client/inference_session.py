"""``InferenceSession``: a generation's steps through a chain of peers, with replay onto replacements.

Each hop of the chain is a ``SpanSession``: a session on one peer, which keeps the KV cache of its blocks;
it travels over the client's one stream to that peer (``PeerStream``), shared with the client's other
sessions there. The client remembers every input it sent to a hop (its history); when a peer fails, the
session bans it, routes the hop's blocks to other peers and replays the history there to rebuild the
cache, so greedy generation continues with the same tokens.

Refusals are not failures: a peer that moved to another span (``MovedError``) is routed around without a ban and the
session replayed elsewhere; a peer with no room for a session (``CapacityError``) is only marked busy and the
session tries another or waits for it; a peer that refuses us as no member (``NotAdmittedError``, or a
``MembershipError`` when the stream is opened) is final and raised at once: every member answers the same.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable

import torch

from peers.client.node import ClientNode
from peers.client.retry import backoff, classify, is_final, report_failure
from peers.core.chunks import first_tokens
from peers.wire.errors import CapacityError, MovedError, RequestError
from peers.wire.messages import InferenceOpen, InferenceRelink, InferenceReplay
from peers.wire.stream import PeerStream
from privacy.errors import MembershipError
from privacy.peer_ids import short_id

logger = logging.getLogger(__name__)

CHAINED_WAIT_FACTOR = 10  # a chained request without a tensor times out after this many request timeouts


class SpanSession:
    """One session on one peer for blocks ``[start, end)``, over the client's shared stream to that peer."""

    def __init__(self, client: ClientNode, peer_id: str, start: int, end: int, session_id: str) -> None:
        self.client, self.peer_id, self.start, self.end = client, peer_id, start, end
        self.session_id = session_id
        self.history: list[torch.Tensor] = []  # inputs sent, in order
        self.length = 0
        self._stream: PeerStream | None = None
        self._step_seconds: float | None = None  # EMA of this hop's single-token step time
        # the chain (``peers.client.chain_session``): the peers before and after this one ("": the client)
        self.upstream = self.downstream = self.downstream_session = ""
        self.batch_rows = 0

    async def open(self, max_length: int, batch_size: int, *, resume: bool = False) -> None:
        """Open the session on the peer (``resume``: re-attach this client's detached session)."""
        self._stream = await self.client.peer_stream(self.peer_id)
        timeout = self.client.config.request_timeout
        adapter = await self.client.adapter.name_for(self._stream, self.start, self.end, timeout)
        request = InferenceOpen(session_id=self.session_id, start=self.start, end=self.end,
                                max_length=max_length, batch_size=batch_size, resume=resume, upstream=self.upstream,
                                downstream=self.downstream, downstream_session=self.downstream_session,
                                compression=self._compression, adapter=adapter)
        reply = await self._stream.open(request, self.client.config.request_timeout)
        if reply.error:
            raise classify(RequestError(f"peer {short_id(self.peer_id)} refused the session: {reply.error}"))
        self.length, self.batch_rows = reply.length, batch_size

    async def step(self, hidden: torch.Tensor) -> torch.Tensor:
        """Send tokens ``[length, length + T)``; return the hop's output hidden states."""
        return await self.step_at(self.length, hidden)

    async def step_at(self, position: int, hidden: torch.Tensor) -> torch.Tensor:
        """Send tokens ``[position, position + T)`` (below ``length`` rolls the peer's cache back)."""
        if self._stream is None:
            raise RuntimeError("open the session first")
        if position < self.length:
            self.length, self.history = position, first_tokens(self.history, position)
        t0 = time.perf_counter()
        try:
            output = await self._stream.step(self.session_id, position, hidden, self._step_timeout(hidden.shape[1]),
                                             codec=self.client.config.codec)
        except RequestError as e:
            raise classify(e) from None
        self.history.append(hidden)
        self.length += hidden.shape[1]
        if hidden.shape[1] == 1:
            elapsed = time.perf_counter() - t0
            self._step_seconds = elapsed if self._step_seconds is None else 0.9 * self._step_seconds + 0.1 * elapsed
        return output

    def queue(self, position: int, hidden: torch.Tensor | None, *, tokens: int, returns: bool, hold: bool = False
              ) -> asyncio.Future:
        """Chain: queue this hop's step at ``position`` now (``hidden`` None: its upstream pushes the input); the
        future gets the output if ``returns`` (the last hop), else None once the hop pushed it downstream."""
        if self._stream is None:
            raise RuntimeError("open the session first")
        # a hop waiting for its input may wait through a whole recovery upstream: heartbeats prove it alive meanwhile
        # (a request's timeout ends the stream, and the session with it), and the peer bounds the wait itself
        timeout = self.client.config.request_timeout * (1 if hidden is not None else CHAINED_WAIT_FACTOR)
        return self._stream.queue_step(self.session_id, position, hidden, timeout,
                                       rows=self.batch_rows if returns else 0, hold=hold, tokens=tokens,
                                       codec=self.client.config.codec)

    def relink(self, *, upstream: str | None = None, downstream: SpanSession | None = None) -> None:
        """Chain: tell the peer this session's new upstream (or downstream), no reply awaited."""
        if upstream is not None:
            self.upstream = upstream
        if downstream is not None:
            self.downstream, self.downstream_session = downstream.peer_id, downstream.session_id
        if self._stream is not None:
            self._stream.send_without_reply(InferenceRelink(
                session_id=self.session_id, set_upstream=upstream is not None, upstream=self.upstream,
                set_downstream=downstream is not None, downstream=self.downstream,
                downstream_session=self.downstream_session))

    def replay(self, upto: int, downstream: SpanSession) -> Awaitable:
        """Chain: have the peer push the outputs it kept for tokens ``[0, upto)`` into ``downstream`` (a
        replacement of the failed next hop), which becomes its downstream."""
        if self._stream is None:
            raise RuntimeError("open the session first")
        self.downstream, self.downstream_session = downstream.peer_id, downstream.session_id
        return self._stream.submit(InferenceReplay(session_id=self.session_id, upto=upto, downstream=downstream.peer_id,
                                                   downstream_session=downstream.session_id),
                                   None, self.client.config.request_timeout)

    @property
    def _compression(self) -> str:
        """The client's codec for the peer's outputs ("": none, which every peer version understands)."""
        codec = self.client.config.codec
        return "" if codec.exact else str(codec)

    @property
    def alive(self) -> bool:
        return self._stream is not None and not self._stream.closed

    def _step_timeout(self, tokens: int) -> float:
        """A dead peer is noticed in a few typical step times, not after the whole request timeout."""
        config = self.client.config
        if tokens > 1 or self._step_seconds is None:
            return config.request_timeout
        adaptive = max(config.min_step_timeout, config.step_timeout_factor * self._step_seconds)
        return min(config.request_timeout, adaptive)

    async def close(self) -> None:
        """Tell the peer to free the cache now."""
        if self._stream is not None:
            self._stream.close_sessions([self.session_id])

    def abandon(self) -> None:
        """Leave the session without freeing it: the peer keeps the cache for a resume until its timeout."""
        if self._stream is not None:
            self._stream.close_sessions([self.session_id], detach=True)


def link(hops: list[SpanSession], upstream: str = "", downstream: SpanSession | None = None) -> None:
    """Chain the hops: each one's output goes to the next one's session; the first takes its input from ``upstream``
    ("": the client), the last hands its output to ``downstream`` (None: the client)."""
    for before, after in zip([None, *hops], [*hops, downstream], strict=True):
        if before is not None:
            before.downstream = after.peer_id if after is not None else ""
            before.downstream_session = after.session_id if after is not None else ""
        if after is not None and after in hops:
            after.upstream = before.peer_id if before is not None else upstream



class InferenceSession:
    """Steps of one generation (``batch_size`` rows, up to ``max_length`` tokens) through the swarm."""

    def __init__(self, client: ClientNode, *, max_length: int, batch_size: int = 1) -> None:
        if max_length < 1 or batch_size < 1:
            raise ValueError("max_length and batch_size must be >= 1")
        self.client, self.max_length, self.batch_size = client, max_length, batch_size
        self.hops: list[SpanSession] = []
        self._local_past = None  # KV cache of the client's local blocks
        self.length = 0
        self.recoveries = 0  # replacements made so far (for tests and benchmarks)

    async def __aenter__(self) -> InferenceSession:
        self.hops = await self._open_chain(self.client.first_remote, self.client.model_config.num_layers)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for hop in self.hops:
            try:
                await hop.close()
            except Exception as e:
                logger.debug("Closing a hop: %s", e)
        self.hops = []

    async def step(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states of the next tokens ``[batch, T, hidden]`` through all blocks."""
        x = self._first_blocks(hidden)
        index, failures = 0, 0
        while index < len(self.hops):
            hop = self.hops[index]
            started = time.monotonic()
            try:
                out = await hop.step(x)
            except MovedError as e:  # the peer serves another span now: replay elsewhere, no ban
                failures += 1
                await self._replace(index, e, failures, started)
                continue
            except (RequestError, MembershipError):  # refused with a reason, or as no member: final
                raise
            except Exception as e:
                failures += 1
                await self._replace(index, e, failures, started)
                continue
            self.client.router.on_success(hop.peer_id)  # its timing reached the router from the stream
            x, index = out, index + 1
        self.length += hidden.shape[1]
        return x

    def _first_blocks(self, hidden: torch.Tensor) -> torch.Tensor:
        """Check a step's shape, then run the client's local blocks on it: what the first peer gets."""
        if hidden.shape[0] != self.batch_size:
            raise ValueError(f"this session has batch size {self.batch_size}, got {hidden.shape[0]}")
        if self.length + hidden.shape[1] > self.max_length:
            total = self.length + hidden.shape[1]
            raise ValueError(f"{total} tokens exceed the session's max_length {self.max_length}")
        return self._local_step(hidden).detach().to("cpu", self.client.dtype)

    @torch.inference_mode()
    def _local_step(self, hidden: torch.Tensor) -> torch.Tensor:
        """The client's own first blocks (``local_blocks``), with their KV cache kept here."""
        blocks = self.client.local_blocks
        if blocks is None:
            return hidden
        tokens = hidden.shape[1]
        positions = torch.arange(self.length, self.length + tokens, device=hidden.device).expand(hidden.shape[0], -1)
        out, self._local_past = blocks(hidden, positions, self._local_past)
        return out

    async def _replace(self, index: int, error: BaseException, failures: int, started: float) -> None:
        """Ban the failed hop's peer (once per failure event: its other sessions see the same one), route its
        blocks elsewhere and replay its history there."""
        failed = self.hops[index]
        report_failure(self.client.router, failed.peer_id, error, (failed.start, failed.end), started)
        failed.abandon()
        if failures > self.client.config.max_retries:
            raise RuntimeError(
                f"blocks {failed.start}:{failed.end} failed {failures} times (last: {error}); "
                f"check `swarm status` and that the peers serving them are reachable"
            ) from error
        await asyncio.sleep(backoff(failures))
        replacement = await self._open_chain(failed.start, failed.end)
        if failed.history:
            replay = torch.cat(failed.history, dim=1)
            for hop in replacement:
                replay = await hop.step(replay)
        self.hops[index : index + 1] = replacement
        self.recoveries += 1
        logger.info("Replaced peer %s (blocks %d:%d) with %s after: %s", short_id(failed.peer_id), failed.start,
                    failed.end, ", ".join(f"{short_id(h.peer_id)} ({h.start}:{h.end})" for h in replacement), error)

    async def _open_chain(self, start: int, end: int, *, linked: bool = False, upstream: str = "",
                          downstream: SpanSession | None = None) -> list[SpanSession]:
        """Sessions on a chain for ``[start, end)``. A busy peer is routed around (the router waits for one to be
        free up to its ``max_wait``); a failing one is banned and the chain re-chosen, ``max_retries`` times.

        ``linked``: each session pushes its outputs to the next one (the chain topology); the first takes its
        inputs from ``upstream`` ("": the client), the last pushes to ``downstream`` (None: back to the client)."""
        router, attempts = self.client.router, 0
        deadline = time.monotonic() + router.max_wait
        refused: dict[str, str] = {}  # peers that had no room for this session: what they said
        while True:
            chain = await router.make_chain(start, end, wait=max(0.0, deadline - time.monotonic()))
            hops = [SpanSession(self.client, h.peer_id, h.start, h.end, secrets.token_hex(16)) for h in chain]
            if linked:
                link(hops, upstream, downstream)
            started = time.monotonic()
            results = await asyncio.gather(*(h.open(self.max_length, self.batch_size) for h in hops),
                                           return_exceptions=True)
            failed = [(h, r) for h, r in zip(hops, results, strict=True) if isinstance(r, BaseException)]
            if not failed:
                return hops
            for hop, result in zip(hops, results, strict=True):
                if not isinstance(result, BaseException):
                    await hop.close()
            final = next((r for _, r in failed if is_final(r)), None)
            if final is not None:  # refused with a reason (or as no member): another try would be refused alike
                raise final
            for hop, result in failed:
                if isinstance(result, CapacityError):
                    router.on_busy(hop.peer_id, result)
                    refused[hop.peer_id] = str(result)
                else:  # a peer that moved off the span is only routed around (no ban)
                    report_failure(router, hop.peer_id, result, (hop.start, hop.end), started)
            if all(isinstance(r, CapacityError) for _, r in failed):  # not a failure: try others, or wait
                if time.monotonic() >= deadline:
                    raise router.unavailable_error(start, end, refused)
                continue
            attempts += 1
            if attempts > self.client.config.max_retries:
                raise RuntimeError(f"could not open an inference session for blocks {start}:{end}: {failed[0][1]}")
