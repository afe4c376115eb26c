"""A small discrete-event run of jobs over first-come-first-served resources (pure, deterministic).

A job is a list of steps: ``Use(resource, seconds)`` holds a resource (a peer's event loop and compute thread, the
client's loop, one direction of a link) for that long, waiting its turn behind earlier requests; ``Wait(seconds)``
is a delay that holds nothing (latency, the p2p daemons). Jobs start in order, at most ``in_flight`` at once: the
next one starts when one ends, like the trainer's semaphore over a step's micro-batches. With ``cores``, a use marked
``core`` (CPU work) also needs one of that many cores shared by every resource (hosts emulated on one machine, as
the testbed does): it takes its resource, then waits for a core in order of arrival.
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Use:
    resource: str
    seconds: float
    kind: str = ""  # what the time is: "compute", "link", "stream", "client" (for the breakdowns)
    core: bool = False  # CPU work: needs a core when the run has ``cores``


@dataclass(frozen=True)
class Wait:
    seconds: float
    kind: str = ""


Step = Use | Wait


@dataclass(frozen=True)
class Run:
    """When each job ended, and how long each resource was held in all."""

    ends: tuple[float, ...]
    busy: dict[str, float]

    @property
    def makespan(self) -> float:
        return max(self.ends, default=0.0)


def run(jobs: Sequence[Sequence[Step]], in_flight: int, cores: int | None = None) -> Run:
    """Run ``jobs`` from time 0, at most ``in_flight`` at once; resources serve requests in order of arrival."""
    if in_flight < 1:
        raise ValueError(f"in_flight must be >= 1, got {in_flight}")
    if cores is not None and cores < 1:
        raise ValueError(f"cores must be >= 1 (or None: every host has its own), got {cores}")
    events: list[tuple[float, int, Callable[[], None]]] = []
    order = itertools.count()
    held: set[str] = set()
    queues: dict[str, deque[tuple[float, Callable[[float], None], bool]]] = defaultdict(deque)
    busy: dict[str, float] = defaultdict(float)
    ends = [0.0] * len(jobs)
    waiting = iter(range(len(jobs)))

    def at(when: float, action: Callable[[], None]) -> None:
        heapq.heappush(events, (when, next(order), action))

    free_cores = [cores]
    core_queue: deque[tuple[float, Callable[[float], None]]] = deque()  # (start time, what to run on the core)

    def with_core(now: float, work: Callable[[float], None]) -> None:
        if free_cores[0] is None:
            work(now)
        elif free_cores[0] > 0:
            free_cores[0] -= 1
            work(now)
        else:
            core_queue.append((now, work))

    def core_done(now: float) -> None:
        if free_cores[0] is None:
            return
        if core_queue:
            _, work = core_queue.popleft()
            work(now)
        else:
            free_cores[0] += 1

    def occupy(resource: str, seconds: float, now: float, then: Callable[[float], None], core: bool = False) -> None:
        held.add(resource)

        def start(begin: float) -> None:
            busy[resource] += seconds

            def release() -> None:
                end = begin + seconds
                if core:
                    core_done(end)
                if queues[resource]:
                    after, go, needs = queues[resource].popleft()
                    occupy(resource, after, end, go, needs)
                else:
                    held.discard(resource)
                then(end)

            at(begin + seconds, release)

        if core:
            with_core(now, start)
        else:
            start(now)

    def advance(job: int, index: int, now: float) -> None:
        steps = jobs[job]
        if index == len(steps):
            ends[job] = now
            start_next(now)
            return
        step = steps[index]
        if isinstance(step, Wait):
            at(now + step.seconds, lambda: advance(job, index + 1, now + step.seconds))
        elif step.resource in held:
            queues[step.resource].append((step.seconds, lambda end: advance(job, index + 1, end), step.core))
        else:
            occupy(step.resource, step.seconds, now, lambda end: advance(job, index + 1, end), step.core)

    def start_next(now: float) -> None:
        job = next(waiting, None)
        if job is not None:
            at(now, lambda: advance(job, 0, now))

    for _ in range(min(in_flight, len(jobs))):
        start_next(0.0)
    while events:
        _, _, action = heapq.heappop(events)
        action()
    return Run(tuple(ends), dict(busy))


def total(steps: Sequence[Step], kind: str | None = None) -> float:
    """The seconds of ``steps`` (of one ``kind``), as if nothing else ran."""
    return sum(s.seconds for s in steps if kind is None or s.kind == kind)
