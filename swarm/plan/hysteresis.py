"""Whether to switch to a new plan: only when it is clearly better than the plan in force, priced today.

Moving peers costs (blocks reloaded, sessions replayed), and measurements wobble: a plan that wins by a few percent
today may lose tomorrow. So the plan in force is re-priced with today's measurements (its spans as they are) and a
candidate replaces it only if it beats that by ``margin``, or if the plan in force no longer works (a stage's peer
is gone, its span no longer fits the peer's memory, or it is for another model size or objective).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from swarm.estimator.inputs import ModelShape
from swarm.plan.costs import MESSAGE_TOKENS, CostModel
from swarm.plan.types import Group, LinkCost, Plan, PlanPeer

MARGIN = 0.15


def reprice(plan: Plan, peers: Sequence[PlanPeer], links: LinkCost, *, shape: ModelShape,
            message_tokens: int = MESSAGE_TOKENS) -> Plan | None:
    """``plan`` with each group's ``seconds_per_token`` priced from today's ``peers`` and ``links`` (its spans
    unchanged); None if it no longer works: a stage's peer is not in ``peers``, a span exceeds the peer's
    ``max_blocks``, or the plan is not for ``shape.num_blocks`` blocks."""
    if plan.num_blocks != shape.num_blocks:
        return None
    cost = CostModel(shape, plan.objective, message_tokens)
    by_id = {p.peer_id: p for p in peers}
    groups = []
    for group in plan.groups:
        spans = []
        for stage in group.stages:
            peer = by_id.get(stage.peer_id)
            if peer is None or stage.end - stage.start > peer.max_blocks:
                return None
            spans.append((peer, stage.end - stage.start))
        groups.append(Group(group.stages, cost.bottleneck(spans, links)))
    return dataclasses.replace(plan, groups=tuple(groups))


def should_adopt(current: Plan | None, candidate: Plan, peers: Sequence[PlanPeer], links: LinkCost,
                 margin: float = MARGIN, *, shape: ModelShape, message_tokens: int = MESSAGE_TOKENS) -> bool:
    """True if ``candidate`` should replace ``current``: there is none, it no longer works (``reprice`` is None),
    it has no group, it is for another objective, or the candidate's tokens/s exceeds the current plan's re-priced
    tokens/s by more than ``margin`` (0.15: 15 %). ``peers``, ``links``: today's snapshot; ``shape``: the model's."""
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    if current is None or current.objective != candidate.objective or not current.groups:
        return True
    today = reprice(current, peers, links, shape=shape, message_tokens=message_tokens)
    if today is None:
        return True
    return candidate.tokens_per_s > today.tokens_per_s * (1 + margin)
