"""``Inbox``: tensors that other peers pushed to this one (the chain), each waiting for the client's request that
uses it, or a request waiting for its tensor; whichever comes first waits for the other.

Bounded: at most ``max_entries`` tensors and ``max_bytes`` in all; a tensor nobody takes is dropped after
``ttl`` seconds (its client went away). A push for a key that holds an untaken tensor replaces it (a retry after a
re-route pushes the same step again).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from peers.wire.errors import RequestError


@dataclass(eq=False)
class _Slot:
    future: asyncio.Future
    nbytes: int = 0
    since: float = field(default_factory=time.monotonic)
    waited: bool = False  # a request waits on it


class Inbox:
    """Pushed tensors by key, e.g. ``(session_id, position)``."""

    def __init__(self, *, max_entries: int = 4096, max_bytes: int = 256 << 20, ttl: float = 120.0) -> None:
        self.max_entries, self.max_bytes, self.ttl = max_entries, max_bytes, ttl
        self._slots: dict[Hashable, _Slot] = {}

    @property
    def bytes_held(self) -> int:
        return sum(s.nbytes for s in self._slots.values())

    def __len__(self) -> int:
        return len(self._slots)

    def put(self, key: Hashable, tensor: torch.Tensor) -> None:
        """Deliver ``tensor`` to the request that waits for ``key`` (now or later); ``RequestError`` if full."""
        self._reap()
        slot = self._slots.get(key)
        nbytes = tensor.numel() * tensor.element_size()
        if slot is not None and slot.future.done():  # an untaken tensor: the later push wins
            del self._slots[key]
            slot = None
        if slot is None:
            if len(self._slots) >= self.max_entries or self.bytes_held + nbytes > self.max_bytes:
                raise RequestError(f"this peer's inbox of pushed tensors is full ({len(self._slots)} tensors, "
                                   f"{self.bytes_held >> 20} MiB); retry later or route elsewhere")
            slot = self._slots[key] = _Slot(asyncio.get_running_loop().create_future())
        slot.nbytes, slot.since = nbytes, time.monotonic()
        slot.future.set_result(tensor)

    async def take(self, key: Hashable, timeout: float, what: str = "the input") -> torch.Tensor:
        """The tensor pushed for ``key``, waiting up to ``timeout`` s for it; ``RequestError`` after that."""
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = _Slot(asyncio.get_running_loop().create_future())
        if slot.waited:
            raise RequestError(f"another request already waits for {what}")
        slot.waited = True
        try:
            return await asyncio.wait_for(asyncio.shield(slot.future), timeout)
        except asyncio.TimeoutError:
            raise RequestError(f"{what} did not arrive within {timeout:.1f} s") from None
        finally:
            if self._slots.get(key) is slot:
                del self._slots[key]

    def fail(self, match: Callable[[Hashable], bool], reason: str) -> int:
        """Fail the requests waiting for keys that ``match`` (and drop such tensors); how many there were."""
        keys = [k for k in self._slots if match(k)]
        for key in keys:
            slot = self._slots.pop(key)
            if slot.waited and not slot.future.done():
                slot.future.set_exception(RequestError(reason))
        return len(keys)

    def drop_untaken(self, match: Callable[[Hashable], bool]) -> None:
        """Forget tensors that no request took yet for keys that ``match`` (their pusher is no longer the upstream)."""
        for key in [k for k, s in self._slots.items() if match(k) and not s.waited]:
            del self._slots[key]

    def _reap(self) -> None:
        now = time.monotonic()
        for key in [k for k, s in self._slots.items() if not s.waited and now - s.since > self.ttl]:
            del self._slots[key]
