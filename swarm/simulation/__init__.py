"""Swarm-scale simulation (pure, no network, deterministic for a seed): the real planner and broker logic driven by
a discrete-event run of a population with churn.

- ``devices``: device classes and models from public spec figures; a device's per-token seconds and blocks it holds.
- ``network``: hosts at homes or in datacenters, in regions; the link between any two (bandwidth, round trip).
- ``population``: a mix of device classes; draws peers (id, device, host) and their ``PlanPeer``.
- ``churn``: Poisson joins and exponential lifetimes, rates per hour.
- ``events``: the event loop (a heap of timed actions).
- ``measured``: which links the broker knows (each peer's few measured neighbours, and its pipeline hops).
- ``broker``: re-plans with ``swarm.plan.make_plan`` / ``should_adopt``, hands a leaver's span to a backup.
- ``metrics``: achieved throughput over time against the bound, recoveries, moves, planner seconds.
- ``run``: ``simulate(SimConfig)``.
"""

from swarm.simulation.churn import Churn
from swarm.simulation.devices import CATALOG, MODELS, DeviceClass, ModelSpec, figures
from swarm.simulation.population import HETEROGENEOUS, Kind, Population, SimPeer
from swarm.simulation.run import SimConfig, SimResult, simulate

__all__ = ["CATALOG", "HETEROGENEOUS", "MODELS", "Churn", "DeviceClass", "Kind", "ModelSpec", "Population",
           "SimConfig", "SimPeer", "SimResult", "figures", "simulate"]
