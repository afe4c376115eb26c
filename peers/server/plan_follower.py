"""``PlanFollower``: a peer's loop that reads the published plans, follows the one it trusts, and moves to its place.

Every update period (with jitter) it fetches the swarm's records and plans, and:

- in a private swarm, if it is the elected broker (``swarm.plan.trust.swarm_broker``), makes the swarm-wide plan
  and publishes it signed (``broker``, optional: a callable that returns the plan to publish);
- picks the plan it trusts (``swarm.plan.trust.pick_plan``): a run of a trainer its ``--trainers`` allow, else the
  private swarm broker's plan; in a public swarm without a trusted run, its own plan (``self_plan``, optional);
- moves to its place in that plan (:func:`decide`): other blocks (``move_to``), or the backup pool.

At most one move per period. :func:`decide` is pure; the I/O comes in as callables, so the loop is testable.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from privacy.peer_ids import short_id
from swarm.discovery import announce_plan, fetch_plans, fetch_records
from swarm.estimator import ModelShape
from swarm.plan.broker import next_plan, plan_for
from swarm.plan.trust import PlanKey, key_of, next_version, pick_plan, swarm_broker
from swarm.plan.types import Plan
from swarm.records import PeerRecord

logger = logging.getLogger(__name__)

PLAN_TTL_PERIODS = 3  # a swarm broker's plan lives this many update periods (republished every period)
JITTER = 0.2  # fraction of the period added at random to each wait: peers do not all move at once


class Movable(Protocol):
    """What the follower needs of a ``StageServer``."""

    @property
    def span(self) -> tuple[int, int] | None: ...  # None while a backup

    async def move_to(self, start: int, end: int) -> None: ...

    async def become_backup(self) -> None: ...


@dataclass(frozen=True)
class Decision:
    """What a peer does about a plan: ``stay``, ``move`` to blocks ``[start, end)``, or become a ``backup``."""

    action: str
    start: int = 0
    end: int = 0
    reason: str = ""


def decide(plan: Plan | None, peer_id: str, span: tuple[int, int] | None) -> Decision:
    """Where ``plan`` puts ``peer_id``, against what it serves now (``span``; None: a backup)."""
    if plan is None:
        return Decision("stay", reason="no plan to follow")
    place = plan.place_of(peer_id)
    if place is not None:
        if span == place.span:
            return Decision("stay", reason=f"already at {place.start}:{place.end}")
        return Decision("move", place.start, place.end, f"plan v{plan.version} of {short_id(plan.broker)} puts it at "
                                                        f"{place.start}:{place.end}")
    if peer_id in plan.backups:
        if span is None:
            return Decision("stay", reason="already a backup")
        return Decision("backup", reason=f"plan v{plan.version} of {short_id(plan.broker)} makes it a backup")
    return Decision("stay", reason=f"plan v{plan.version} does not name this peer (it joined later)")


class PlanFollower:
    """Follows the plans of a swarm for one peer (see the module's docstring)."""

    def __init__(self, server: Movable, peer_id: str, *, period: float, private: bool,
                 may_train: Callable[[str], bool],
                 fetch_records: Callable[[], Awaitable[Sequence[PeerRecord]]],
                 fetch_plans: Callable[[], Awaitable[list[Plan]]],
                 publish: Callable[[Plan], Awaitable[bool]] | None = None,
                 broker: Callable[[Sequence[PeerRecord], list[Plan], Plan | None], Plan | None] | None = None,
                 self_plan: Callable[[Sequence[PeerRecord], Plan | None], Plan | None] | None = None) -> None:
        self.server, self.peer_id, self.period, self.private = server, peer_id, period, private
        self.may_train, self.fetch_records, self.fetch_plans = may_train, fetch_records, fetch_plans
        self.publish, self.broker, self.self_plan = publish, broker, self_plan
        self.current: Plan | None = None  # the plan followed now
        self.followed: dict[PlanKey, int] = {}  # highest version followed per (broker, run)
        self.brokered: Plan | None = None  # the swarm-wide plan this peer published as the broker
        self.own: Plan | None = None  # public swarm: the last plan this peer made for itself

    async def run(self) -> None:
        """Every period (plus jitter), one :meth:`step`; errors are logged and the loop goes on."""
        while True:
            await asyncio.sleep(self.period * (1.0 + random.uniform(0.0, JITTER)))
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                logger.warning("Plan follower: this round failed (%r); retrying next period", e)

    async def step(self) -> Decision:
        """One round: broker duty (if elected), pick the plan, move if it puts this peer elsewhere."""
        records = await self.fetch_records()
        plans = await self.fetch_plans()
        if self.private and self.broker is not None and self.publish is not None \
                and swarm_broker(records) == self.peer_id:
            plan = self.broker(records, plans, self.brokered)
            if plan is not None:
                if self.brokered is None or plan.version != self.brokered.version:
                    logger.info("Broker of the swarm: publishing plan v%d (%d group(s), %d backup(s))", plan.version,
                                len(plan.groups), len(plan.backups))
                await self.publish(plan)  # again each period: its record lives a few periods
                self.brokered = plan
                plans = [p for p in plans if key_of(p) != key_of(plan)] + [plan]
        plan = pick_plan(plans, records, private=self.private, may_train=self.may_train, current=self.current,
                         followed=self.followed)
        if plan is None and not self.private and self.self_plan is not None:
            plan = self.own = self.self_plan(records, self.own)
        elif plan is not None:
            if self.current is None or key_of(plan) != key_of(self.current) or plan.version != self.current.version:
                logger.info("Following plan v%d of %s%s", plan.version, short_id(plan.broker),
                            f" (run {plan.run_id})" if plan.run_id else " (the swarm's broker)")
            self.current = plan
            self.followed[key_of(plan)] = max(plan.version, self.followed.get(key_of(plan), -1))
        decision = decide(plan, self.peer_id, self.server.span)
        if decision.action == "move":
            logger.info("Moving to blocks %d:%d: %s", decision.start, decision.end, decision.reason)
            await self.server.move_to(decision.start, decision.end)
        elif decision.action == "backup":
            logger.info("Becoming a backup: %s", decision.reason)
            await self.server.become_backup()
        return decision


def plan_following(server: Any) -> list[Coroutine[Any, Any, None]]:
    """The follower's loop for a running ``StageServer`` (a list to add to its background tasks): empty with
    ``--no_follow``. Runs' plans are followed per ``--trainers``; with ``--organise`` the peer also takes part in
    the swarm-wide plan (private swarm: the elected broker's; public: its own, moving only itself)."""
    config = server.config
    if not config.follow_plans:
        return []
    node, model, period = server.node, server.model_name, config.update_period
    cfg = server.model_config
    shape = ModelShape(cfg.hidden_size, cfg.num_layers, server.dtype.itemsize)
    private = bool(server.admission.required)
    policy = config.trainer_policy()
    organise = bool(getattr(config, "organise", False))

    async def records() -> Sequence[PeerRecord]:
        return await asyncio.wait_for(fetch_records(node, model), config.swarm.dht_timeout)

    async def plans() -> list[Plan]:
        return await asyncio.wait_for(fetch_plans(node, model), config.swarm.dht_timeout)

    async def publish(plan: Plan) -> bool:
        return await asyncio.wait_for(announce_plan(node, plan, server.identity, PLAN_TTL_PERIODS * period),
                                      config.swarm.dht_timeout)

    def planned(records: Sequence[PeerRecord], current: Plan | None, broker: str, version: int) -> Plan:
        return next_plan(records, current, shape=shape, model=model, objective="inference", broker=broker,
                         now=time.time(), first_version=version, local=server.link_table, local_id=server.peer_id)

    def broker(records: Sequence[PeerRecord], found: list[Plan], last: Plan | None) -> Plan | None:
        if last is None:  # just elected: carry on from the last broker's plan, as this broker, after its version
            before = max((p for p in found if not p.run_id), key=lambda p: p.version, default=None)
            return plan_for(records, shape=shape, model=model, objective="inference", version=next_version(found),
                            broker=server.peer_id, now=time.time(), current=before, local=server.link_table,
                            local_id=server.peer_id)
        return planned(records, last, server.peer_id, next_version(found))

    def self_plan(records: Sequence[PeerRecord], own: Plan | None) -> Plan | None:
        return planned(records, own, "", 0 if own is None else own.version + 1)

    follower = PlanFollower(server, server.peer_id, period=period, private=private, may_train=policy.allows,
                            fetch_records=records, fetch_plans=plans, publish=publish,
                            broker=broker if organise else None, self_plan=self_plan if organise else None)
    return [follower.run()]
