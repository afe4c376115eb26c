"""The simulated broker: it runs the real planner (``swarm.plan``) on the peers it believes alive, adopts a candidate
plan when ``should_adopt`` says so, and hands a leaver's span to a backup.

Re-plans: ``replan`` plans every peer with the plan in force as ``current`` (its tokens/s is the bound);
``replan_free`` keeps the running groups and plans only the free peers (backups, joiners, survivors of broken
groups), which costs a fraction of a full plan at 10,000 peers.

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
        self.ever: dict[str, SimPeer] = {}  # every peer seen (a broken group still names its leavers)
        self.visible: set[str] = set()  # the peers the broker believes alive (a leaver until it is detected)
        self.groups: list[GroupState] = []
        self.group_of: dict[str, GroupState] = {}
        self.held: dict[str, tuple[int, int]] = {}  # the span whose weights a peer holds (loaded or loading)
        self.achieved = 0.0  # tokens/s of the working groups
        self._adopted: Plan | None = None  # the last plan adopted (backups repair its groups in ``groups``)
        self._token: dict[str, int] = {}  # bumps with each assignment: a stale "loaded" event is ignored
        self._waiting: list[tuple[Recovery, set[GroupState]]] = []  # recoveries a re-plan's new groups close

    @property
    def plan(self) -> Plan | None:
        """The plan in force: the last adopted one with the backups' takeovers since (None before the first)."""
        if self._adopted is None:
            return None
        groups = tuple(state.group for state in self.groups)
        if groups == self._adopted.groups:
            return self._adopted
        named = {s.peer_id for g in groups for s in g.stages}
        return replace(self._adopted, groups=groups, backups=tuple(b for b in self._adopted.backups
                                                                    if b not in named))

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
        if state.recovery is None:
            state.recovery = Recovery(self.loop.now, lost=state.rate)
            self.metrics.recoveries.append(state.recovery)
        self._down(state, peer_id)
        self.loop.after(self.detect_s + self.plan_period_s, lambda: self.repair(state, peer_id))

    # --- plans ------------------------------------------------------------------------------------------------
    def plan_peers(self, exclude: set[str] | frozenset[str] = frozenset()) -> list[PlanPeer]:
        """What the planner is given: every peer the broker believes alive that can hold a block, but ``exclude``
        (a plan names at most ``MAX_PEERS``: beyond, the fastest per block held)."""
        able = [self.ever[i] for i in self.visible if i not in exclude and self.ever[i].can_serve]
        room = MAX_PEERS - len(exclude)
        if len(able) > room:
            able.sort(key=lambda p: (p.figures.forward_s / min(p.figures.max_blocks, self.model.num_blocks),
                                     p.peer_id))
            able = able[:room]
        return sorted((p.plan_peer for p in able), key=lambda p: p.peer_id)

    def replan(self, *, warm: bool = False) -> Plan:
        """A full re-plan: the planner on every peer the broker sees, the plan in force as ``current``; adopted if
        ``should_adopt`` (or there is none yet). Its tokens/s is the bound for this population. ``warm``: the
        adopted peers already hold their spans (a swarm that was running before the simulation)."""
        peers = self.plan_peers()
        view = LinkView(self.known.table())
        current = self.plan
        candidate = self._make(peers, view, current)
        self.metrics.set_bound(self.loop.now, candidate.tokens_per_s, len(self.peers))
        if current is None or should_adopt(current, candidate, peers, view, margin=self.margin, shape=self.shape):
            self.adopt(candidate, warm=warm)
        return candidate

    def replan_free(self) -> Plan | None:
        """An incremental re-plan: the groups whose peers the broker still sees stay as they are; the planner
        groups the others (backups, joiners, the survivors of broken groups). Adopted when it adds a group or a
        broken group is dissolved; None when there was nothing to do."""
        current = self.plan
        if current is None:
            return self.replan()
        intact = [st for st in self.groups if all(s.peer_id in self.visible for s in st.group.stages)]
        used = {s.peer_id for st in intact for s in st.group.stages}
        free = self.plan_peers(exclude=used)
        if not free and len(intact) == len(self.groups):
            return None
        view = LinkView(self.known.table(among={p.peer_id for p in free}))
        sub = self._make(free, view, None)
        if not sub.groups and len(intact) == len(self.groups):
            return None
        plan = replace(sub, groups=tuple(st.group for st in intact) + sub.groups)
        self.adopt(plan)
        return plan

    def _make(self, peers: list[PlanPeer], view: LinkView, current: Plan | None) -> Plan:
        version = (self._adopted.version + 1) if self._adopted else 1
        started = time.perf_counter()
        plan = make_plan(peers, self.model.num_blocks, view, shape=self.shape, objective=self.objective,
                         model=self.model.name, version=version, broker=BROKER_ID, now=self.loop.now,
                         current=current)
        self.metrics.plan_seconds.append(time.perf_counter() - started)
        self.metrics.plan_sizes.append(len(peers))
        return plan

    def adopt(self, plan: Plan, *, warm: bool = False) -> None:
        """Switch to ``plan``: groups it keeps as they are run on; the others' peers move (and load)."""
        old = {state.key: state for state in self.groups}
        states: list[GroupState] = []
        fresh: list[GroupState] = []
        moving: list[tuple[Assignment, GroupState]] = []
        for group in plan.groups:
            key = tuple((s.peer_id, s.start, s.end) for s in group.stages)
            state = old.pop(key, None)
            if state is not None:
                state.group = group
                states.append(state)
                continue
            state = GroupState(group, self._true_rate(group))
            fresh.append(state)
            states.append(state)
            for stage in group.stages:
                peer_id = stage.peer_id
                if peer_id not in self.peers:
                    state.down.add(peer_id)  # left, not yet detected: the group is down from the start
                elif warm:
                    self.held[peer_id] = stage.span
                elif self.held.get(peer_id) != stage.span:
                    moving.append((stage, state))
                elif (previous := self.group_of.get(peer_id)) is not None and peer_id in previous.down:
                    state.down.add(peer_id)  # still loading the same span: its load event will say
            for a, b in zip(group.stages, group.stages[1:], strict=False):
                self.known.measure(a.peer_id, b.peer_id)
        for state in old.values():  # dropped groups
            if state.working:
                self.achieved -= state.rate
            state.retired = True
            if state.recovery is not None and state.recovery.end is None:
                if fresh:  # its lost rate waits for the new groups
                    state.recovery.how = "replan"
                    self._waiting.append((state.recovery, set(fresh)))
                else:
                    state.recovery.how, state.recovery.end = "dissolved", self.loop.now
        for _, waiting in self._waiting:
            if any(s.retired for s in waiting):
                waiting.difference_update({s for s in waiting if s.retired})
                waiting.update(fresh)
        self._adopted, self.groups = plan, states
        self.group_of = {s.peer_id: state for state in states for s in state.group.stages}
        self.achieved += sum(state.rate for state in fresh if state.working)
        for stage, state in moving:
            self._assign(stage, state, self.plan_period_s)
        self.metrics.plans_adopted += 1
        self.metrics.rate(self.loop.now, self.achieved)
        self._close_waiting()

    def repair(self, state: GroupState, gone: str) -> None:
        """A backup takes ``gone``'s span in ``state`` (the fitting backup that gives the group the smallest
        bottleneck on the known links); none fits: the group stays down until a re-plan."""
        if state.retired or gone in self.peers:
            return
        index = next((i for i, s in enumerate(state.group.stages) if s.peer_id == gone), None)
        if index is None:
            return
        stage = state.group.stages[index]
        blocks = stage.end - stage.start
        pool = sorted(i for i in self.visible if i not in self.group_of
                      and min(self.ever[i].figures.max_blocks, self.model.num_blocks) >= blocks)
        if not pool:
            return
        stages = list(state.group.stages)
        near = {n for s in stages[max(0, index - 1):index + 2] for n in self.known.near.get(s.peer_id, ())}
        chosen = [self.ever[i] for i in pool if i in near]
        chosen += [self.ever[i] for i in self.rng.sample(pool, min(REPAIR_CANDIDATES, len(pool)))]

        def bottleneck(peer: SimPeer) -> float:
            spans = [(self.ever[s.peer_id].plan_peer, s.end - s.start) for s in stages]
            spans[index] = (peer.plan_peer, blocks)
            return self.cost.bottleneck(spans, self.known)

        best = min(chosen, key=lambda p: (bottleneck(p), p.peer_id))
        stages[index] = Assignment(best.peer_id, stage.start, stage.end)
        state.group = Group(tuple(stages), bottleneck(best))
        state.rate = self._true_rate(state.group)
        if state.recovery is not None and not state.recovery.how:
            state.recovery.how = "backup"
        del self.group_of[gone]
        self.group_of[best.peer_id] = state
        for other in stages[max(0, index - 1):index + 2]:
            self.known.measure(best.peer_id, other.peer_id)
        self._assign(stages[index], state, 0.0)
        self.metrics.takeovers += 1
        self._up(state, gone)

    # --- internals --------------------------------------------------------------------------------------------
    def _assign(self, stage: Assignment, state: GroupState, delay: float) -> None:
        """``stage.peer_id`` moves to ``stage``'s span: it learns so after ``delay``, then loads what it lacks."""
        peer_id = stage.peer_id
        self._down(state, peer_id)
        if peer_id not in self.peers:  # left, not yet detected: it will never load
            return
        start, end = self.held.get(peer_id, (0, 0))
        have = max(0, min(end, stage.end) - max(start, stage.start))
        load = self.ever[peer_id].load_s(stage.end - stage.start - have, self.model)
        self.held[peer_id] = stage.span
        token = self._token[peer_id] = self._token.get(peer_id, 0) + 1
        self.metrics.moves += 1
        self.loop.after(delay + load, lambda: self._loaded(peer_id, token))

    def _loaded(self, peer_id: str, token: int) -> None:
        """``peer_id`` holds its span now (unless it moved again or left since)."""
        if self._token.get(peer_id) != token or peer_id not in self.peers:
            return
        state = self.group_of.get(peer_id)
        if state is not None and any(s.peer_id == peer_id and s.span == self.held.get(peer_id)
                                     for s in state.group.stages):
            self._up(state, peer_id)

    def _down(self, state: GroupState, peer_id: str) -> None:
        if state.working:
            self.achieved -= state.rate
            self.metrics.rate(self.loop.now, self.achieved)
        state.down.add(peer_id)

    def _up(self, state: GroupState, peer_id: str) -> None:
        if peer_id not in state.down:
            return
        state.down.discard(peer_id)
        if state.working:
            self.achieved += state.rate
            self.metrics.rate(self.loop.now, self.achieved)
            if state.recovery is not None:
                state.recovery.end = self.loop.now
                state.recovery = None
            self._close_waiting()

    def _close_waiting(self) -> None:
        """A re-plan's recovery ends when its new groups that work make up the lost rate, or all of them work."""
        still = []
        for recovery, waiting in self._waiting:
            working = sum(s.rate for s in waiting if s.working)
            if working >= recovery.lost * (1 - 1e-9) or all(s.working for s in waiting):
                recovery.end = self.loop.now
            else:
                still.append((recovery, waiting))
        self._waiting = still

    def _true_rate(self, group: Group) -> float:
        spans = [(self.ever[s.peer_id].plan_peer, s.end - s.start) for s in group.stages]
        return 1.0 / self.cost.bottleneck(spans, self.true_links)
