"""The simulated broker: it runs the real planner (``swarm.plan``) on the live population, adopts a candidate plan
when ``should_adopt`` says so, and hands a leaver's span to a backup.

Timing (each a parameter): a departure is noticed ``detect_s`` later (its record expires); the repaired plan reaches
the peers within ``plan_period_s`` (they read it at their next heartbeat); the backup then loads the span's weights
(``SimPeer.load_s``). So a backup's takeover restores the group ``detect_s + plan_period_s + load`` after the
departure. An adopted plan likewise moves its peers ``plan_period_s`` after the decision, each loading the blocks it
does not hold yet; a group works while every one of its stages is alive and loaded (make-before-break is not
modelled: a re-cut group is down while its movers load, which only costs where the re-plan moved peers).

Throughput: a working group serves ``1 / bottleneck`` tokens/s, its bottleneck priced by the planner's own
``CostModel`` on the *true* links of the simulated network (the plan was made on the known links only).
"""

from __future__ import annotations

import random
import time
from dataclasses import replace

from swarm.estimator.inputs import ModelShape
from swarm.plan import CostModel, LinkView, make_plan, should_adopt
from swarm.plan.types import MAX_PEERS, Assignment, Group, LinkCost, Plan, PlanPeer
from swarm.simulation.devices import ModelSpec
from swarm.simulation.events import EventLoop
from swarm.simulation.measured import KnownLinks
from swarm.simulation.metrics import Metrics, Recovery
from swarm.simulation.population import SimPeer

BROKER_ID = "12D3KooWSimulatedBroker1111111111111111111111111"
REPAIR_CANDIDATES = 48  # backups priced per repair besides the neighbours of the broken stage


class GroupState:
    """A group of the adopted plan as it runs: which of its stages are down (gone, or still loading)."""

    def __init__(self, group: Group, rate: float) -> None:
        self.group, self.rate = group, rate
        self.down: set[str] = set()
        self.recovery: Recovery | None = None
        self.retired = False

    @property
    def working(self) -> bool:
        return not self.down and not self.retired

    @property
    def key(self) -> tuple[tuple[str, int, int], ...]:
        return tuple((s.peer_id, s.start, s.end) for s in self.group.stages)


class SimBroker:
    def __init__(self, loop: EventLoop, metrics: Metrics, model: ModelSpec, known: KnownLinks,
                 true_links: LinkCost, *, objective: str = "training", detect_s: float = 31.0,
                 plan_period_s: float = 15.0, margin: float = 0.15, seed: int = 0) -> None:
        self.loop, self.metrics, self.model, self.known, self.true_links = loop, metrics, model, known, true_links
        self.objective, self.detect_s, self.plan_period_s, self.margin = objective, detect_s, plan_period_s, margin
        self.shape = ModelShape(model.hidden_size, model.num_blocks, model.dtype_bytes)
        self.cost = CostModel(self.shape, objective)
        self.rng = random.Random(seed)
        self.peers: dict[str, SimPeer] = {}  # live
        self.visible: set[str] = set()  # the peers the broker believes alive (a leaver until it is detected)
        self.ever: dict[str, SimPeer] = {}  # every peer seen (a broken group still names its leavers)
        self.plan: Plan | None = None
        self.groups: list[GroupState] = []
        self.group_of: dict[str, GroupState] = {}
        self.held: dict[str, tuple[int, int]] = {}  # the span whose weights a peer holds (loaded or loading)
        self._token: dict[str, int] = {}  # bumps with each assignment: a stale "loaded" event is ignored
        self._waiting: list[tuple[Recovery, set[GroupState]]] = []  # recoveries a re-plan's new groups close
        self.view: LinkView = LinkView({})

    # --- the population ---------------------------------------------------------------------------------------
    def join(self, peer: SimPeer) -> None:
        """``peer`` joins: it announces itself, so the broker sees it at once."""
        self.peers[peer.peer_id] = peer
        self.ever[peer.peer_id] = peer
        self.visible.add(peer.peer_id)
        self.known.join(peer.peer_id, peer.host)

    def leave(self, peer_id: str) -> None:
        """``peer_id`` leaves without a word: its group goes down now, the broker learns it ``detect_s`` later."""
        self.peers.pop(peer_id, None)
        self.known.leave(peer_id)
        self.held.pop(peer_id, None)
        self.loop.after(self.detect_s, lambda: self.visible.discard(peer_id))
        state = self.group_of.get(peer_id)
        if state is None:
            return
        was_working = state.working
        state.down.add(peer_id)
        if was_working:
            self._set_rate()
        if state.recovery is None:
            state.recovery = Recovery(self.loop.now)
            self.metrics.recoveries.append(state.recovery)
        self.loop.after(self.detect_s + self.plan_period_s, lambda: self.repair(state, peer_id))

    # --- plans ------------------------------------------------------------------------------------------------
    def plan_peers(self, exclude: set[str] | frozenset[str] = frozenset()) -> list[PlanPeer]:
        """What the planner is given: every peer the broker believes alive that can hold a block, but ``exclude``
        (at most ``MAX_PEERS``: the fastest)."""
        able = [self.ever[i] for i in self.visible if i not in exclude and self.ever[i].can_serve]
        if len(able) > MAX_PEERS:
            able.sort(key=lambda p: (p.figures.forward_s / min(p.figures.max_blocks, self.model.num_blocks),
                                     p.peer_id))
            able = able[:MAX_PEERS]
        return sorted((p.plan_peer for p in able), key=lambda p: p.peer_id)

    def replan(self, *, warm: bool = False) -> Plan:
        """A full re-plan: the planner on every peer the broker sees, the plan in force as ``current``; adopted if
        ``should_adopt`` (or there is none yet). Its tokens/s is the bound for this population. ``warm``: the
        adopted peers already hold their spans (a swarm that was running before the simulation)."""
        peers = self.plan_peers()
        self.view = LinkView(self.known.table())
        candidate = self._make(peers, self.plan)
        self.metrics.set_bound(self.loop.now, candidate.tokens_per_s, len(self.peers))
        if self.plan is None or should_adopt(self.plan, candidate, peers, self.view, margin=self.margin,
                                             shape=self.shape):
            self.adopt(candidate, warm=warm)
        return candidate

    def replan_free(self) -> Plan | None:
        """An incremental re-plan: the groups whose peers the broker still sees stay as they are; the planner
        groups the others (backups, joiners, the survivors of broken groups). Adopted when it adds a group or a
        broken group is dissolved; None when there was nothing to do."""
        if self.plan is None:
            return self.replan()
        intact = [st for st in self.groups if all(s.peer_id in self.visible for s in st.group.stages)]
        used = {s.peer_id for st in intact for s in st.group.stages}
        free = self.plan_peers(exclude=used)
        if not free:
            return None
        self.view = LinkView(self.known.table())
        sub = self._make(free, None)
        if not sub.groups and len(intact) == len(self.groups):
            return None
        plan = replace(sub, groups=tuple(st.group for st in intact) + sub.groups)
        self.adopt(plan)
        return plan

    def _make(self, peers: list[PlanPeer], current: Plan | None) -> Plan:
        version = (self.plan.version + 1) if self.plan else 1
        started = time.perf_counter()
        plan = make_plan(peers, self.model.num_blocks, self.view, shape=self.shape, objective=self.objective,
                         model=self.model.name, version=version, broker=BROKER_ID, now=self.loop.now,
                         current=current)
        self.metrics.plan_seconds.append(time.perf_counter() - started)
        self.metrics.plan_sizes.append(len(peers))
        return plan

    def adopt(self, plan: Plan, *, warm: bool = False) -> None:
        old = {state.key: state for state in self.groups}
        states: list[GroupState] = []
        fresh: set[GroupState] = set()
        for group in plan.groups:
            key = tuple((s.peer_id, s.start, s.end) for s in group.stages)
            state = old.pop(key, None)
            if state is None:
                state = GroupState(group, self._true_rate(group))
                fresh.add(state)
                for stage in group.stages:
                    if stage.peer_id not in self.peers:
                        state.down.add(stage.peer_id)  # left, not yet detected: the group is down from the start
                    elif warm:
                        self.held[stage.peer_id] = stage.span
                    elif self.held.get(stage.peer_id) != stage.span:
                        self._assign(stage, state, self.plan_period_s)
                    elif (previous := self.group_of.get(stage.peer_id)) is not None \
                            and stage.peer_id in previous.down:
                        state.down.add(stage.peer_id)  # still loading the same span: its load event will say
                    for a, b in zip(group.stages, group.stages[1:], strict=False):
                        self.known.measure(a.peer_id, b.peer_id)
            else:
                state.group = group
            states.append(state)
        for state in old.values():  # dropped groups: their open recoveries wait for the new groups
            state.retired = True
            if state.recovery is not None and state.recovery.end is None:
                state.recovery.how = "replan"
                self._waiting.append((state.recovery, {s for s in fresh if not s.working}))
        for _, waiting in self._waiting:
            if any(s.retired for s in waiting):
                waiting.difference_update({s for s in waiting if s.retired})
                waiting.update(s for s in fresh if not s.working)
        self.plan, self.groups = plan, states
        self.group_of = {s.peer_id: state for state in states for s in state.group.stages}
        self.metrics.plans_adopted += 1
        self._set_rate()
        self._close_waiting()

    def repair(self, state: GroupState, gone: str) -> None:
        """A backup takes ``gone``'s span in ``state`` (the fitting backup that gives the group the smallest
        bottleneck on the known links); none fits: the group stays down until a re-plan."""
        if state.retired or self.plan is None or gone in self.peers:
            return
        index = next((i for i, s in enumerate(state.group.stages) if s.peer_id == gone), None)
        if index is None:
            return
        stage = state.group.stages[index]
        blocks = stage.end - stage.start
        pool = [self.ever[i] for i in self.visible if i not in self.group_of
                and min(self.ever[i].figures.max_blocks, self.model.num_blocks) >= blocks]
        if not pool:
            return
        stages = list(state.group.stages)
        near = {n for s in stages[max(0, index - 1):index + 2] for n in self.known.near.get(s.peer_id, ())}
        pool.sort(key=lambda p: p.peer_id)
        chosen = [p for p in pool if p.peer_id in near]
        chosen += self.rng.sample(pool, min(REPAIR_CANDIDATES, len(pool)))

        def bottleneck(peer: SimPeer) -> float:
            spans = [(self.ever[s.peer_id].plan_peer, s.end - s.start) for s in stages]
            spans[index] = (peer.plan_peer, blocks)
            return self.cost.bottleneck(spans, self.view)

        best = min(chosen, key=lambda p: (bottleneck(p), p.peer_id))
        stages[index] = Assignment(best.peer_id, stage.start, stage.end)
        group = Group(tuple(stages), bottleneck(best))
        groups = tuple(group if g is state.group else g for g in self.plan.groups)
        backups = tuple(b for b in self.plan.backups if b != best.peer_id)
        self.plan = replace(self.plan, version=self.plan.version + 1, groups=groups, backups=backups,
                            made_at=self.loop.now)
        state.group, state.rate = group, self._true_rate(group)
        if state.recovery is not None and not state.recovery.how:
            state.recovery.how = "backup"
        state.down.discard(gone)
        del self.group_of[gone]
        self.group_of[best.peer_id] = state
        for other in stages[max(0, index - 1):index + 2]:
            self.known.measure(best.peer_id, other.peer_id)
        self._assign(stages[index], state, 0.0)
        self._set_rate()

    # --- internals --------------------------------------------------------------------------------------------
    def _assign(self, stage: Assignment, state: GroupState, delay: float) -> None:
        """``stage.peer_id`` moves to ``stage``'s span: it learns so after ``delay``, then loads what it lacks."""
        if stage.peer_id not in self.peers:  # left, not yet detected: it will never load
            state.down.add(stage.peer_id)
            return
        peer = self.ever[stage.peer_id]
        start, end = self.held.get(stage.peer_id, (0, 0))
        have = max(0, min(end, stage.end) - max(start, stage.start))
        load = peer.load_s(stage.end - stage.start - have, self.model)
        self.held[stage.peer_id] = stage.span
        token = self._token[stage.peer_id] = self._token.get(stage.peer_id, 0) + 1
        state.down.add(stage.peer_id)
        self.metrics.moves += 1
        self.loop.after(delay + load, lambda: self._loaded(stage.peer_id, state, token))

    def _loaded(self, peer_id: str, state: GroupState, token: int) -> None:
        if self._token.get(peer_id) != token or peer_id not in self.peers:
            return
        if peer_id in state.down:
            state.down.discard(peer_id)
            if state.working:
                self._set_rate()
        if self.group_of.get(peer_id) is not state:  # the peer was re-assigned meanwhile, in a later plan
            current = self.group_of.get(peer_id)
            if current is not None and peer_id in current.down and self.held.get(peer_id) == \
                    next(s.span for s in current.group.stages if s.peer_id == peer_id):
                current.down.discard(peer_id)
                self._set_rate()

    def _set_rate(self) -> None:
        now = self.loop.now
        for state in self.groups:
            if state.working and state.recovery is not None:
                state.recovery.end = now
                state.recovery = None
        self.metrics.rate(now, sum(state.rate for state in self.groups if state.working))
        self._close_waiting()

    def _close_waiting(self) -> None:
        still = []
        for recovery, waiting in self._waiting:
            waiting.difference_update({s for s in waiting if s.working})
            if waiting:
                still.append((recovery, waiting))
            else:
                recovery.end = self.loop.now
        self._waiting = still

    def _true_rate(self, group: Group) -> float:
        spans = [(self.ever[s.peer_id].plan_peer, s.end - s.start) for s in group.stages]
        return 1.0 / self.cost.bottleneck(spans, self.true_links)
