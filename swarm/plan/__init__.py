"""Self-organisation: the plan of pipeline groups, stages and backups (pure), and how it is made and shared.

- ``types``: ``PlanPeer`` (the planner's view of a peer), ``Assignment``, ``Group``, ``Plan`` (wire format, bounded).
- ``costs``: ``CostModel``, per-token seconds of a stage and of a hop, as the estimator prices them.
- ``linkview``: ``LinkView``, the measured links indexed once (and each peer's known neighbours), defaults otherwise.
- ``partition``: ``partition``, the exact optimal cut of the blocks over peers in a fixed order.
- ``ordering``: ``order_group``, the best order and cut of a group (exact up to 8 peers, a heuristic beyond).
- ``grouping``: ``group_peers``, groups along fast measured links (tiers, sites, paths); the rest are backups.
- ``planner``: ``make_plan``, a snapshot in, a ``Plan`` out (deterministic; keeps current groups when free).
- ``hysteresis``: ``should_adopt`` (switch only when clearly better than the current plan priced today), ``reprice``.
- ``from_records``: ``plan_peers`` and ``link_view_from_records``: the planner's input from a DHT snapshot.
- ``synthetic``: seeded synthetic swarms (sites, sparse links) for tests, benchmarks and simulations.

Sharing and trusting plans (the broker's side):

- ``signed``: ``sign_plan`` / ``verify_plan``, a plan as the DHT carries it, signed by its broker under its peer id.
- ``trust``: ``swarm_broker`` (a private swarm's election), ``pick_plan`` (which plan a peer may follow).
- ``broker``: ``plan_for`` / ``next_plan``, a snapshot to the plan to publish (hysteresis, version + 1).
- ``route``: ``price_groups`` / ``plan_route``, the live group the estimator prices fastest for a client.
- ``graph_cut``: ``plan_graph_cut``, the exact cut of an operator graph's topological order over a chain of peers.
"""

from swarm.plan.costs import CostModel
from swarm.plan.from_records import link_view_from_records, plan_peers
from swarm.plan.grouping import group_peers
from swarm.plan.hysteresis import reprice, should_adopt
from swarm.plan.linkview import LinkView
from swarm.plan.ordering import order_group
from swarm.plan.partition import Partition, partition
from swarm.plan.planner import make_plan
from swarm.plan.types import Assignment, Group, LinkCost, Plan, PlanPeer

__all__ = [
    "Assignment", "CostModel", "Group", "LinkCost", "LinkView", "Partition", "Plan", "PlanPeer", "group_peers",
    "link_view_from_records", "make_plan", "order_group", "partition", "plan_peers", "reprice", "should_adopt",
]
