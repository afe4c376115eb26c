"""One simulation: a population with churn, the broker re-planning every ``replan_s``, metrics over time.

Deterministic for a seed: the population, the churn and the broker's choices each draw from their own generator.
The swarm starts warm (the first plan's peers already hold their spans, as in a swarm that was running before).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from swarm.plan.types import Plan
from swarm.simulation.broker import SimBroker
from swarm.simulation.churn import Churn, arrivals, lifetime
from swarm.simulation.devices import MODELS
from swarm.simulation.events import EventLoop
from swarm.simulation.measured import KnownLinks
from swarm.simulation.metrics import Metrics
from swarm.simulation.network import Host, link
from swarm.simulation.population import HETEROGENEOUS, Kind, Population, SimPeer


@dataclass(frozen=True)
class SimConfig:
    model: str = "llama-2-13b"
    memory: str = "adapters"  # what a stage keeps per weight (devices.MEMORY_MODES)
    objective: str = "training"
    peers: int = 10_000  # at the start
    mix: tuple[Kind, ...] = HETEROGENEOUS
    regions: tuple[str, ...] = ("na", "eu", "asia")
    datacenter_rate: float | None = None  # bits/s of every datacenter NIC (None: drawn per site)
    churn: Churn = field(default_factory=Churn)
    duration_s: float = 3600.0
    replan_s: float = 60.0  # the broker re-plans this often: incrementally (the free peers), or in full when due
    full_replan_s: float | None = None  # a full re-plan (every peer; the bound) this often (None: every re-plan)
    detect_s: float = 31.0  # a departure is noticed when its record expires (2 x 15 s heartbeat + 1)
    plan_period_s: float = 15.0  # a new plan reaches the peers at their next heartbeat
    margin: float = 0.15  # should_adopt's hysteresis
    bucket_s: float = 60.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; known: {sorted(MODELS)}")
        for name in ("duration_s", "replan_s", "bucket_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SimConfig.{name} must be > 0")
        if self.full_replan_s is not None and not self.full_replan_s >= self.replan_s:
            raise ValueError("SimConfig.full_replan_s must be >= replan_s (or None)")
        for name in ("detect_s", "plan_period_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"SimConfig.{name} must be >= 0")
        if not isinstance(self.peers, int) or self.peers < 1:
            raise ValueError(f"SimConfig.peers must be an integer >= 1, got {self.peers!r}")


@dataclass
class SimResult:
    config: SimConfig
    metrics: Metrics
    first_plan: Plan
    broker: SimBroker
    joined: int
    left: int


def simulate(config: SimConfig, progress: Callable[[float], None] | None = None,
             initial: Sequence[SimPeer] | None = None) -> SimResult:
    """Run ``config``; ``progress(now)`` after each re-plan; ``initial``: the starting peers (else drawn)."""
    model = MODELS[config.model]
    population = Population(random.Random(config.seed), model, config.mix, memory=config.memory,
                            regions=config.regions, datacenter_rate=config.datacenter_rate)
    churn_rng = random.Random(config.seed + 1)
    loop, metrics = EventLoop(), Metrics(bucket_s=config.bucket_s)
    hosts: dict[str, Host] = {}
    known = KnownLinks(random.Random(config.seed + 2), link)
    broker = SimBroker(loop, metrics, model, known, lambda a, b: link(hosts[a], hosts[b]),
                       objective=config.objective, detect_s=config.detect_s, plan_period_s=config.plan_period_s,
                       margin=config.margin, seed=config.seed + 3)
    start = list(initial) if initial is not None else [population.draw() for _ in range(config.peers)]
    mean_life = config.churn.mean_lifetime_s(len(start))
    counts = {"joined": 0, "left": 0}

    def arrive(peer: SimPeer) -> None:
        hosts[peer.peer_id] = peer.host
        broker.join(peer)
        life = lifetime(churn_rng, mean_life)
        if math.isfinite(life) and loop.now + life <= config.duration_s:
            loop.at(loop.now + life, lambda: depart(peer.peer_id))

    def depart(peer_id: str) -> None:
        counts["left"] += 1
        broker.leave(peer_id)

    def join() -> None:
        counts["joined"] += 1
        arrive(population.draw())

    for peer in start:
        arrive(peer)
    first = broker.replan(warm=True)
    for when in arrivals(churn_rng, config.churn.joins_per_hour, config.duration_s):
        loop.at(when, join)

    full_every = config.full_replan_s or config.replan_s
    last_full = [0.0]

    def tick() -> None:
        if loop.now - last_full[0] >= full_every - 1e-9:
            last_full[0] = loop.now
            broker.replan()
        else:
            broker.replan_free()
        if progress is not None:
            progress(loop.now)
        if loop.now + config.replan_s < config.duration_s:
            loop.after(config.replan_s, tick)

    if config.replan_s < config.duration_s:
        loop.at(config.replan_s, tick)
    loop.run(config.duration_s)
    metrics.advance(config.duration_s)
    return SimResult(config, metrics, first, broker, counts["joined"], counts["left"])
