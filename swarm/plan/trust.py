"""Which plan a peer may follow: the swarm broker's election and the choice among published plans (pure).

- A training run's plan (``run_id`` set) is made by its trainer; a peer follows it only if its operator lets that
  trainer train it (``--trainers``): the trust it already gives the trainer over its weights.
- A swarm-wide plan (no ``run_id``) exists only in a private swarm, where each peer id needs the owner's invite:
  its broker is the live member with the smallest peer id (:func:`swarm_broker`), which every member computes
  from its own snapshot. When the broker leaves (its record is OFFLINE or expired) the next one takes over.
- In a public swarm peer ids are free to mint, so nobody is the swarm's broker: whoever mints the smallest id
  would capture it. There each peer plans for itself (``public_self_plan`` in the follower) and moves only itself.

A plan whose version is not newer than the one a peer follows from the same broker and run is ignored (a stale
replica, or a replay of an older plan).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from swarm.plan.types import Plan
from swarm.records import PeerRecord, PeerState

PlanKey = tuple[str, str]  # (broker, run_id) of a plan


def key_of(plan: Plan) -> PlanKey:
    return plan.broker, plan.run_id


def swarm_broker(records: Iterable[PeerRecord]) -> str | None:
    """The private swarm's broker: the smallest peer id among the peers whose record is alive (not OFFLINE;
    expired records are not in a snapshot). None if there is none."""
    alive = [r.peer_id for r in records if r.state != PeerState.OFFLINE]
    return min(alive) if alive else None


def next_version(plans: Iterable[Plan], run_id: str = "") -> int:
    """The version a (new) broker of ``run_id`` ("" : the swarm-wide plan) publishes next: the highest seen + 1."""
    return max((p.version for p in plans if p.run_id == run_id), default=-1) + 1


def trusted_plans(plans: Iterable[Plan], records: Sequence[PeerRecord], *, private: bool,
                  may_train: Callable[[str], bool]) -> list[Plan]:
    """The plans this peer may follow: runs of trainers it lets train it, and (private swarm) the swarm-wide plan
    of the broker it elects itself."""
    broker = swarm_broker(records) if private else None
    return [p for p in plans if (may_train(p.broker) if p.run_id else (private and p.broker == broker))]


def pick_plan(plans: Iterable[Plan], records: Sequence[PeerRecord], *, private: bool,
              may_train: Callable[[str], bool], current: Plan | None,
              followed: dict[PlanKey, int] | None = None) -> Plan | None:
    """The plan to follow now (``current`` if nothing better), or None.

    A run's plan wins over the swarm-wide one (a trainer is working on the peers now). Among runs, the one
    followed now stays while its trainer publishes it; else the newest (``made_at``). ``followed`` maps each
    (broker, run) to the highest version followed from it: a plan that is not newer is ignored.
    """
    followed = followed or {}
    trusted = trusted_plans(plans, records, private=private, may_train=may_train)
    fresh = [p for p in trusted if p.version > followed.get(key_of(p), -1)
             or (current is not None and key_of(p) == key_of(current) and p.version == current.version)]
    runs = [p for p in fresh if p.run_id]
    pool = runs or [p for p in fresh if not p.run_id]
    if not pool:
        return None
    if current is not None:
        same = [p for p in pool if key_of(p) == key_of(current)]
        if same:
            return max(same, key=lambda p: p.version)
    return max(pool, key=lambda p: (p.made_at, p.version, p.broker))
