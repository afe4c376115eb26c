"""A background event loop, so that synchronous callers (scripts, notebooks, tests) can use async code."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
CLEANUP_S = 5.0  # how long an iterator left early gets to clean up (``BackgroundLoop.iterate``)


@contextlib.asynccontextmanager
async def deadline(seconds: float) -> AsyncIterator[None]:
    """Raise ``asyncio.TimeoutError`` if the block takes longer than ``seconds``.

    Unlike ``asyncio.wait_for`` it creates no extra task, which matters on per-token paths.
    """
    if hasattr(asyncio, "timeout"):  # Python 3.11+
        async with asyncio.timeout(seconds):
            yield
        return
    task = asyncio.current_task()
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        task.cancel()

    handle = asyncio.get_running_loop().call_later(seconds, expire)
    try:
        yield
    except asyncio.CancelledError:
        if expired:
            raise asyncio.TimeoutError from None
        raise
    finally:
        handle.cancel()


class BackgroundLoop:
    """An asyncio loop running in a daemon thread; ``run(coro)`` blocks until the coroutine finishes."""

    def __init__(self, name: str = "fusionswarm-loop") -> None:
        try:
            import uvloop

            self.loop = uvloop.new_event_loop()
        except ImportError:
            self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if threading.current_thread() is self._thread:
            raise RuntimeError("BackgroundLoop.run() called from its own loop: await the coroutine instead")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def iterate(self, agen: AsyncIterator[T], timeout: float | None = None) -> Iterator[T]:
        """Consume an async iterator on this loop from synchronous code, item by item."""
        items: queue.Queue = queue.Queue()
        future = asyncio.run_coroutine_threadsafe(_pump(agen, items.put), self.loop)
        finished = False
        try:
            while (item := _unwrap(items.get(timeout=timeout))) is not _DONE:
                yield item
            finished = True
        finally:
            if not finished:  # left early: wait (a little) for the iterator's own cleanup, e.g. closing sessions
                future.cancel()
                _drain(items, CLEANUP_S)

    async def aiterate(self, agen: AsyncIterator[T]) -> AsyncIterator[T]:
        """Consume an async iterator that lives on this loop from another event loop."""
        caller, items = asyncio.get_running_loop(), asyncio.Queue()
        future = asyncio.run_coroutine_threadsafe(
            _pump(agen, lambda entry: caller.call_soon_threadsafe(items.put_nowait, entry)), self.loop
        )
        try:
            while (item := _unwrap(await items.get())) is not _DONE:
                yield item
        finally:
            future.cancel()

    def close(self) -> None:
        """Cancel every task still on the loop, then stop and close it."""
        if self.loop.is_closed():
            return
        try:
            self.run(_cancel_all_tasks(), timeout=10)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


async def _cancel_all_tasks() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


_DONE = object()


async def _pump(agen: AsyncIterator, put: Callable[[tuple], object]) -> None:
    """Hand each item of ``agen`` (then its error, if any, then ``_DONE``) to ``put`` as ``(item, error)``."""
    try:
        async for item in agen:
            put((item, None))
    except BaseException as e:  # re-raised in the consumer
        put((None, e))
    finally:
        put((_DONE, None))


def _drain(items: queue.Queue, seconds: float) -> None:
    """Discard ``items`` until ``_pump`` says it is done, for at most ``seconds``."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        try:
            if items.get(timeout=left)[0] is _DONE:
                return
        except queue.Empty:
            return


def _unwrap(entry: tuple):
    item, error = entry
    if error is not None:
        raise error
    return item
