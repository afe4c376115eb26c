"""A trainer as the broker of its own run (``SwarmTrainer(plan=True)``): it plans the run from the swarm's snapshot,
publishes the plan signed, waits for the peers to move to it, and trains on the plan's group that the estimator
prices fastest for this trainer.

Peers follow a run's plan only if their operator lets this trainer train them (``--trainers``), so the plan asks
for nothing beyond the trust they already give it. After a stage fails, the next choice re-plans without the
failed (banned) peer: a backup takes its place in version + 1, and the run resumes once it serves there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from peers.wire.probe import probe_into, unmeasured
from privacy.peer_ids import peer_id_of, short_id
from swarm.discovery import announce_plan, fetch_plans
from swarm.estimator import ModelShape
from swarm.plan.broker import next_plan
from swarm.plan.route import PricedGroup, choose_group, price_groups
from swarm.plan.trust import next_version
from swarm.plan.types import Plan
from swarm.records import PeerRecord
from swarm.stages import NoPipelineError

logger = logging.getLogger(__name__)

PLAN_TTL = 60.0  # seconds a published plan lives in the DHT
REPUBLISH_EVERY = 15.0  # seconds between publications of the same plan (while the trainer runs)
POLL = 0.5  # seconds between snapshots while waiting for the peers to move
NOTICE_EVERY = 5.0  # seconds between "waiting for the move" messages
MAX_PROBES = 16  # links probed per look at the plan's groups
MOVE_PATIENCE = 30.0  # seconds to wait for the fastest group to move before training on a slower one that moved


class RunPlanner:
    """Plans, publishes and waits for one training run (see the module)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        client = trainer.client
        cfg = client.model_config
        self.shape = ModelShape(cfg.hidden_size, cfg.num_layers, client.dtype.itemsize)
        self.me = peer_id_of(client.identity.public_bytes)
        self.plan: Plan | None = None
        self.published_at = -float("inf")
        self.failed_at: float | None = None  # time.monotonic() of the failure that caused the current re-plan
        self.group: PricedGroup | None = None  # the group the run trains on
        self.lost_before = 0
        self.probed: set[str] = set()  # peers whose link we probed (or tried to): once each

    async def groups(self, grace: float) -> list[list[PeerRecord]]:
        """Make (or keep) the run's plan, publish it, wait up to ``grace`` s for one of its groups to serve its
        spans, and return that group's stages, the one priced fastest for this trainer (``NoPipelineError``)."""
        client, trainer = self.trainer.client, self.trainer
        banned = client.router.banned()
        records = await client._fetch()
        first = 0
        if self.plan is None:  # a restarted trainer (same run id) continues after the versions it published
            first = next_version(await self._plans(), trainer.run_id)
        plan = next_plan(records, self.plan, shape=self.shape, model=client.model_name, objective="training",
                         broker=self.me, now=time.time(), first_version=first, run_id=trainer.run_id,
                         local=client.router.links, local_id=self.me, excluded=banned)
        if not plan.groups:
            raise NoPipelineError(f"run {trainer.run_id}: the peers of the swarm ({len(records)} records, "
                                  f"{len(banned)} banned) cannot hold the model's {self.shape.num_blocks} blocks in "
                                  f"one pipeline; start more peers (or --max_blocks)")
        if self.plan is None or plan.version != self.plan.version:
            replanned = self.plan is not None
            self.failed_at = (trainer.broken_since or time.monotonic()) if replanned else None
            self.lost_before = len(trainer.lost_steps)  # lost-step reports of this recovery come after these
            logger.info("Run %s: %s plan v%d: %s; backups: %s", trainer.run_id, "new" if replanned else "the",
                        plan.version, " | ".join(_describe(g.stages) for g in plan.groups),
                        ", ".join(short_id(b) for b in plan.backups) or "none")
        self.plan = plan
        await self.publish(force=True)
        return await self._wait_for_move(plan, grace, banned)

    async def _wait_for_move(self, plan: Plan, grace: float, banned: set[str]) -> list[list[PeerRecord]]:
        client, trainer = self.trainer.client, self.trainer
        began, noticed = time.monotonic(), 0.0
        while True:
            records = await client._fetch()
            await self._probe_ends(plan, records, banned)
            priced = price_groups([plan], records, self.shape, client_id=self.me, local=client.router.links,
                                  excluded=banned, objective="training", micro_batches=trainer.accumulation,
                                  topology=trainer.topology, only_live=False)
            waited = time.monotonic() - began
            chosen = choose_group(priced, records, excluded=banned, waited=waited,
                                  patience=min(MOVE_PATIENCE, grace / 2))
            if chosen is not None:
                self.group = chosen
                by_peer = {r.peer_id: r for r in records}
                logger.info("Run %s: training on group %s of plan v%d (est. %.0f tokens/s; the fastest group, est. "
                            "%.0f tokens/s, %s; the peers were in place after %.1f s)", trainer.run_id,
                            _describe(chosen.group.stages), plan.version, 1.0 / chosen.seconds,
                            1.0 / priced[0].seconds, "is this one" if chosen is priced[0] else "had not moved yet",
                            waited)
                return [[by_peer[s.peer_id]] for s in chosen.group.stages]
            if waited >= grace:
                raise NoPipelineError(f"run {trainer.run_id}: no group of plan v{plan.version} serves its spans after "
                                      f"{waited:.0f} s: do its peers allow this trainer (--trainers {self.me}) and "
                                      f"follow plans (no --no_follow)? `swarm status` shows the plan and who moved")
            if waited - noticed >= NOTICE_EVERY:
                noticed = waited
                logger.info("Run %s: waiting for the peers to move to plan v%d (%.0f s so far)", trainer.run_id,
                            plan.version, waited)
            await self.publish()
            await asyncio.sleep(POLL)

    async def _probe_ends(self, plan: Plan, records: list[PeerRecord], banned: set[str]) -> None:
        """Probe our links to the groups' stages that talk to us (chain: the first and the last; star: all)
        that we never measured, once each: an unknown link prices as the default, so without this a group behind a
        slow uplink looks as near as one on a fast link."""
        client = self.trainer.client
        known = {r.peer_id for r in records}
        ends = [s.peer_id for g in plan.groups for s in (g.stages if self.trainer.topology == "star"
                                                          else (g.stages[0], g.stages[-1]))
                if s.peer_id in known and s.peer_id not in banned]
        todo = [p for p in unmeasured(client.router.links, ends) if p not in self.probed][:MAX_PROBES]
        if todo:
            self.probed.update(todo)
            await probe_into(client.router.links, client.peer_stream, todo, why="its link prices as the default")

    async def publish(self, force: bool = False) -> None:
        """(Re)publish the plan if due: its record must outlive the run's pauses."""
        if self.plan is None or (not force and time.monotonic() - self.published_at < REPUBLISH_EVERY):
            return
        client = self.trainer.client
        try:
            ok = await asyncio.wait_for(announce_plan(client.node, self.plan, client.identity, PLAN_TTL),
                                        client.config.swarm.dht_timeout)
        except Exception as e:
            logger.warning("Run %s: could not publish plan v%d (%r); retrying", self.trainer.run_id,
                           self.plan.version, e)
            return
        if ok:
            self.published_at = time.monotonic()

    def recovered(self) -> None:
        """Log how long the run took to recover from the failure that caused the last re-plan, and the steps its
        blocks lost (a span that came back behind the run: ``SwarmTrainer.lost_steps``), once."""
        if self.failed_at is not None:
            steps_lost = sum(int(e.get("lost", 0)) for e in self.trainer.lost_steps[self.lost_before:])
            logger.info("Run %s: recovered on plan v%d in %.1f s after the failure; steps lost: %d",
                        self.trainer.run_id, self.plan.version if self.plan else -1,
                        time.monotonic() - self.failed_at, steps_lost)
            self.failed_at = None

    async def _plans(self) -> list[Plan]:
        client = self.trainer.client
        try:
            return await asyncio.wait_for(fetch_plans(client.node, client.model_name), client.config.swarm.dht_timeout)
        except Exception as e:
            logger.debug("Could not fetch plans (%r); starting at version 0", e)
            return []


def _describe(stages) -> str:
    return " -> ".join(f"{short_id(s.peer_id)} {s.start}:{s.end}" for s in stages)
