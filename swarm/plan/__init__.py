"""Self-organisation: the plan of pipeline groups, stages and backups (pure), and how it is made and shared.

- ``types``: ``PlanPeer`` (the planner's view of a peer), ``Assignment``, ``Group``, ``Plan`` (wire format, bounded).
"""

from swarm.plan.types import Assignment, Group, LinkCost, Plan, PlanPeer

__all__ = ["Assignment", "Group", "LinkCost", "Plan", "PlanPeer"]
