"""The event loop: a heap of timed actions, run in time order (ties in the order they were scheduled)."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def at(self, when: float, action: Callable[[], None]) -> None:
        """Run ``action`` at simulated time ``when`` (never in the past)."""
        if not math.isfinite(when) or when < self.now:
            raise ValueError(f"cannot schedule at {when!r}: the time is {self.now}")
        heapq.heappush(self._heap, (when, next(self._order), action))

    def after(self, delay: float, action: Callable[[], None]) -> None:
        self.at(self.now + delay, action)

    def run(self, until: float) -> int:
        """Run every action due up to ``until`` (inclusive); the clock ends at ``until``. Returns how many ran."""
        ran = 0
        while self._heap and self._heap[0][0] <= until:
            when, _, action = heapq.heappop(self._heap)
            self.now = when
            action()
            ran += 1
        self.now = max(self.now, until)
        return ran

    def __len__(self) -> int:
        return len(self._heap)
