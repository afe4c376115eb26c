"""``ChainSession``: a generation's steps down a chain of peers that hand their outputs straight to each other.

A step goes client -> first peer -> ... -> last peer -> client: the client's link carries the first peer's input
and the last peer's output only. The client still sends every hop a small request per step (metadata only, except
the first hop's), so that it hears from each one: its reply says when it is done, or which peer failed
(``failed_peer``); its stream's heartbeats say it is alive. Replies come back concurrently.

Recovery without the star's history: each peer keeps the outputs it pushed downstream. When a hop fails, the
client opens a replacement chain for its blocks, points the next hop at the replacement (``relink``), has the
previous hop replay its kept outputs into the replacement (or sends its own inputs, for the first hop), and runs
the step again: hops that still wait for the step's input keep waiting (the replacement pushes it), the others
roll back to the step's position and recompute it, so greedy output stays identical. If the previous hop died too,
recovery moves one hop up (its span joins the failed one) and tries again.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from peers.client.inference_session import InferenceSession, SpanSession
from peers.client.node import ClientNode
from peers.client.retry import backoff, classify, report_failure
from peers.wire.errors import ChainError, MovedError, RequestError
from peers.wire.stream import LIVENESS_TIMEOUT
from privacy.errors import MembershipError
from privacy.peer_ids import short_id

logger = logging.getLogger(__name__)


class _HopFailed(Exception):
    """Hop ``index`` of the route failed (``error`` says how)."""

    def __init__(self, index: int, error: BaseException) -> None:
        super().__init__(f"hop {index} failed: {error}")
        self.index, self.error = index, error


class _SourceFailed(Exception):
    """The hop that should replay its kept outputs into a replacement failed too (``error``)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class ChainSession(InferenceSession):
    """An ``InferenceSession`` whose peers push their outputs to each other (``ClientConfig.topology="chain"``)."""

    def __init__(self, client: ClientNode, *, max_length: int, batch_size: int = 1,
                 span: tuple[int, int] | None = None) -> None:
        """``span``: only these blocks, on hidden states given as they are (no local blocks); default: the blocks
        after the client's ``local_blocks``, which run here first."""
        super().__init__(client, max_length=max_length, batch_size=batch_size)
        self.span = span
        self.inputs: list[torch.Tensor] = []  # what the first hop got: replayed into a replacement of it
        self._step_seconds: float | None = None  # EMA of a single-token step, all hops

    async def __aenter__(self) -> ChainSession:
        start, end = self.span or (self.client.first_remote, self.client.model_config.num_layers)
        self.hops = await self._open_chain(start, end, linked=True)
        return self

    def _local_step(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden if self.span is not None else super()._local_step(hidden)

    async def step(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states of the next tokens ``[batch, T, hidden]`` through all blocks."""
        x = self._first_blocks(hidden)
        position, failures, began = self.length, 0, time.perf_counter()
        pending: dict[SpanSession, asyncio.Future] = {}  # hops' requests for this step still under way
        while True:
            started = time.monotonic()
            for index, hop in enumerate(self.hops):
                if hop not in pending:
                    pending[hop] = hop.queue(position, x if index == 0 else None, tokens=x.shape[1],
                                             returns=index == len(self.hops) - 1)
            try:
                out = await self._outcome(pending, x.shape[1])
                if out is not None:
                    break
            except _HopFailed as failure:
                failures += 1
                await self._recover(failure.index, failure.error, failures, started, position, pending)
            except BaseException:  # e.g. cancelled (the caller went away): the hops' replies are not news
                self._drop(pending)
                raise
        for hop in self.hops:
            self.client.router.on_success(hop.peer_id)
        if x.shape[1] == 1:
            elapsed = time.perf_counter() - began
            self._step_seconds = elapsed if self._step_seconds is None else 0.9 * self._step_seconds + 0.1 * elapsed
        self.inputs.append(x)
        self.length += x.shape[1]
        return out

    async def _outcome(self, pending: dict[SpanSession, asyncio.Future], tokens: int) -> torch.Tensor | None:
        """The last hop's output once every hop is done; ``_HopFailed`` naming the hop to replace otherwise; None
        if some hop must be asked again. Done requests leave ``pending`` (they are sent again after a recovery);
        those still waiting stay."""
        futures = [pending[hop] for hop in self.hops]
        timeout = self._timeout(tokens)
        late = await _until_output(futures, timeout)
        route = {hop.peer_id: i for i, hop in enumerate(self.hops)}
        failure: _HopFailed | None = None
        for index, (hop, future) in enumerate(zip(self.hops, futures, strict=True)):
            if not future.done():
                continue
            del pending[hop]
            error = future.exception()
            if error is None or failure is not None:
                continue
            if isinstance(error, RequestError):
                error = classify(error)
            if isinstance(error, (MembershipError, RequestError)) and not isinstance(error, MovedError):
                # a refusal with a reason: final, as in the star (a peer that moved is replaced, without a ban)
                self._drop(pending)
                raise error
            if isinstance(error, ChainError):
                if error.failed_peer not in route:  # about a peer replaced already: ask this hop again
                    continue
                index = route[error.failed_peer]
            failure = _HopFailed(index, error)
        if failure is not None:
            raise failure
        if any(f.done() and f.exception() is not None for f in futures):
            return None  # a hop spoke of a peer replaced already: ask it again
        if late:  # nothing failed, but the output did not come in time: the first hop still at work is late
            first = next(i for i, f in enumerate(futures) if not f.done())
            raise _HopFailed(first, TimeoutError(f"peer {short_id(self.hops[first].peer_id)} did not finish a step "
                                                 f"within {timeout:.1f} s"))
        self._drop(pending)  # the output is here, so every hop did its part: acks still on their way are not news
        pending.clear()
        return futures[-1].result()

    def _timeout(self, tokens: int) -> float:
        """A stuck peer is noticed in a few typical step times, not after the whole request timeout; but never
        before a silent one is (``LIVENESS_TIMEOUT``: no heartbeat): a dead hop leaves the hops before it waiting
        for their pushes, and a timeout would blame the first of those instead of the dead one."""
        config = self.client.config
        if tokens > 1 or self._step_seconds is None:
            return config.request_timeout
        adaptive = max(config.min_step_timeout, 1.5 * LIVENESS_TIMEOUT, config.step_timeout_factor * self._step_seconds)
        return min(config.request_timeout, adaptive)

    async def _recover(self, index: int, error: BaseException, failures: int, started: float, position: int,
                       pending: dict[SpanSession, asyncio.Future]) -> None:
        """Replace hop ``index`` (and, if the hop before it died too, that one as well) and replay into it."""
        router, config = self.client.router, self.client.config
        lo = hi = index
        failed = self.hops[index]
        report_failure(router, failed.peer_id, error, (failed.start, failed.end), started)
        while True:
            for hop in self.hops[lo : hi + 1]:
                hop.abandon()
            if failures > config.max_retries:
                self._drop(pending)
                raise RuntimeError(f"blocks {self.hops[lo].start}:{self.hops[hi].end} failed {failures} times (last: "
                                   f"{error}); check `swarm status` and that the peers serving them are reachable"
                                   ) from error
            await asyncio.sleep(backoff(failures))
            if lo > 0 and not self.hops[lo - 1].alive or hi + 1 < len(self.hops) and not self.hops[hi + 1].alive:
                # a neighbour's stream ended meanwhile: its session is detached, as good as lost; replace it too
                lo, hi = (lo - 1, hi) if lo > 0 and not self.hops[lo - 1].alive else (lo, hi + 1)
                failures += 1
                continue
            up = self.hops[lo - 1] if lo > 0 else None
            down = self.hops[hi + 1] if hi + 1 < len(self.hops) else None
            replacement = await self._open_chain(self.hops[lo].start, self.hops[hi].end, linked=True,
                                                 upstream=up.peer_id if up else "", downstream=down)
            if down is not None:
                down.relink(upstream=replacement[-1].peer_id)
            try:
                await self._replay(replacement, up, position)
            except _SourceFailed as e:  # the hop that kept the outputs is gone too: replace it as well
                await self._close(replacement)
                assert up is not None
                report_failure(router, up.peer_id, e.error, (up.start, up.end))
                logger.info("Chain: peer %s could not replay into the replacement (%s): it is replaced too",
                            short_id(up.peer_id), e.error)
                lo, failures, error = lo - 1, failures + 1, e.error
                continue
            except _HopFailed as e:  # a replacement failed: choose again
                await self._close(replacement)
                hop = replacement[e.index]
                report_failure(router, hop.peer_id, e.error, (hop.start, hop.end))
                failures, error = failures + 1, e.error
                continue
            for hop in self.hops[lo : hi + 1]:
                future = pending.pop(hop, None)
                if future is not None and future.done():
                    future.exception()
            old = ", ".join(f"{short_id(h.peer_id)} ({h.start}:{h.end})" for h in self.hops[lo : hi + 1])
            self.hops[lo : hi + 1] = replacement
            self.recoveries += 1
            logger.info("Replaced %s with %s after: %s", old, ", ".join(
                f"{short_id(h.peer_id)} ({h.start}:{h.end})" for h in replacement), error)
            return

    async def _replay(self, replacement: list[SpanSession], up: SpanSession | None, position: int) -> None:
        """Rebuild the replacement's caches for tokens ``[0, position)``: the previous hop pushes the outputs it
        kept (or the client sends its own inputs, for the first hop); the last replacement hop pushes nothing."""
        if position == 0:
            if up is not None:
                up.relink(downstream=replacement[0])
            return
        history = torch.cat(self.inputs, dim=1) if up is None else None
        source = up.replay(position, replacement[0]) if up is not None else None
        steps = [hop.queue(0, history if i == 0 else None, tokens=position, returns=False,
                           hold=i == len(replacement) - 1) for i, hop in enumerate(replacement)]
        if source is not None:
            try:
                await source
            except ChainError as e:
                names = [h.peer_id for h in replacement]
                if e.failed_peer in names:
                    self._drop({h: f for h, f in zip(replacement, steps, strict=True)})
                    raise _HopFailed(names.index(e.failed_peer), e) from None
                raise _SourceFailed(e) from None
            except Exception as e:
                self._drop({h: f for h, f in zip(replacement, steps, strict=True)})
                raise _SourceFailed(e) from None
        results = await asyncio.gather(*steps, return_exceptions=True)
        names = [h.peer_id for h in replacement]
        for i, result in enumerate(results):
            if isinstance(result, BaseException):
                culprit = names.index(result.failed_peer) if isinstance(result, ChainError) and \
                    result.failed_peer in names else i
                raise _HopFailed(culprit, result)

    @staticmethod
    def _drop(pending: dict[SpanSession, asyncio.Future]) -> None:
        """Stop caring about these requests (their errors are not news)."""
        for future in pending.values():
            future.add_done_callback(lambda f: f.cancelled() or f.exception())

    @staticmethod
    async def _close(hops: list[SpanSession]) -> None:
        for hop in hops:
            try:
                await hop.close()
            except Exception as e:
                logger.debug("Closing a replacement hop: %s", e)


async def _until_output(futures: list[asyncio.Future], timeout: float) -> bool:
    """Wait until the last future (the output) is done or any fails, at most ``timeout`` s; True if it timed out."""
    give_up = asyncio.get_running_loop().time() + timeout
    waiting = set(futures)
    while not futures[-1].done():
        left = give_up - asyncio.get_running_loop().time()
        if left <= 0:
            return True
        done, waiting = await asyncio.wait(waiting, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        if any(f.exception() is not None for f in done if not f.cancelled()):
            return False
    return False
