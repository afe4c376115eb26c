"""What a plan is made of: the planner's view of a peer, a group's stages, and the plan a broker publishes.

A ``Plan`` assigns every peer it knows either a place in a pipeline ``Group`` (blocks ``[start, end)`` of the model,
contiguous and in pipeline order, the group's stages tiling all blocks) or the backup pool. It is versioned (a newer
version replaces an older one) and names its broker. ``to_wire``/``from_wire`` carry it through the DHT; parsing
bounds every size, so a record from a stranger costs nothing beyond its bytes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from swarm.values import is_int, is_number, shown

MAX_PEERS = 10_000  # peers one plan may name (groups' stages + backups)
MAX_BLOCKS = 100_000  # blocks of a model
_PEER_ID_RE = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{20,80}$")  # base58 libp2p peer id
_MAX_TEXT = 256

# (bandwidth bits/s, round trip s) of the directed link a -> b: measured, or swarm.links' conservative defaults
LinkCost = Callable[[str, str], tuple[float, float]]


@dataclass(frozen=True)
class PlanPeer:
    """What the planner knows of one peer: compute per token per block (forward, backward) and how many blocks its
    memory holds."""

    peer_id: str
    forward_s: float
    backward_s: float
    max_blocks: int

    def __post_init__(self) -> None:
        _check(isinstance(self.peer_id, str) and bool(self.peer_id), f"bad peer_id {self.peer_id!r}")
        for name in ("forward_s", "backward_s"):
            value = getattr(self, name)
            _check(is_number(value) and value > 0, f"PlanPeer.{name} must be a finite number > 0, got {value!r}")
        _check(is_int(self.max_blocks) and self.max_blocks >= 1, f"bad max_blocks {self.max_blocks!r}")


@dataclass(frozen=True)
class Assignment:
    """Blocks ``[start, end)`` on peer ``peer_id``."""

    peer_id: str
    start: int
    end: int

    def __post_init__(self) -> None:
        _check(isinstance(self.peer_id, str) and _PEER_ID_RE.fullmatch(self.peer_id) is not None,
               f"bad peer_id {shown(self.peer_id)}")
        _check(is_int(self.start) and is_int(self.end) and 0 <= self.start < self.end <= MAX_BLOCKS,
               f"bad span {shown(self.start)}:{shown(self.end)}")

    @property
    def span(self) -> tuple[int, int]:
        return self.start, self.end


@dataclass(frozen=True)
class Group:
    """One pipeline: ``stages`` in order, tiling ``[0, num_blocks)``; ``seconds_per_token`` is its bottleneck (the
    slowest of its stages' compute and its links' transfers, per token; training: forward + backward)."""

    stages: tuple[Assignment, ...]
    seconds_per_token: float

    def __post_init__(self) -> None:
        _check(isinstance(self.stages, tuple) and len(self.stages) >= 1
               and all(isinstance(s, Assignment) for s in self.stages), "a group needs a tuple of Assignment")
        _check(self.stages[0].start == 0, f"a group starts at block {self.stages[0].start}, not 0")
        for before, after in zip(self.stages, self.stages[1:], strict=False):
            _check(before.end == after.start, f"a group's stages are not contiguous: {before.end} then {after.start}")
        _check(is_number(self.seconds_per_token) and self.seconds_per_token > 0,
               f"bad seconds_per_token {shown(self.seconds_per_token)}")

    @property
    def num_blocks(self) -> int:
        return self.stages[-1].end

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.seconds_per_token


@dataclass(frozen=True)
class Plan:
    """A swarm's (or a run's) plan: pipeline groups and the backup pool, with its version and broker."""

    model: str
    num_blocks: int
    version: int
    groups: tuple[Group, ...]
    backups: tuple[str, ...] = ()
    broker: str = ""  # peer id of the broker that made it ("" for a plan made locally and never published)
    made_at: float = 0.0  # unix time
    objective: str = "training"  # "training" (forward + backward per token) or "inference" (forward only)
    run_id: str = ""  # a training run's plan: the run it is for ("" for a swarm-wide plan)
    peers: tuple[str, ...] = field(default=(), compare=False)  # (derived) every peer named, sorted

    def __post_init__(self) -> None:
        _check(isinstance(self.model, str) and 0 < len(self.model) <= _MAX_TEXT, "bad model name")
        _check(is_int(self.num_blocks) and 1 <= self.num_blocks <= MAX_BLOCKS, f"bad num_blocks {self.num_blocks!r}")
        _check(is_int(self.version) and self.version >= 0, f"bad version {shown(self.version)}")
        _check(isinstance(self.groups, tuple) and all(isinstance(g, Group) for g in self.groups),
               "groups must be a tuple of Group")
        for group in self.groups:
            _check(group.num_blocks == self.num_blocks,
                   f"a group covers blocks 0:{group.num_blocks}, the model has {self.num_blocks}")
        _check(isinstance(self.backups, tuple) and all(isinstance(b, str) and _PEER_ID_RE.fullmatch(b)
                                                        for b in self.backups), "backups must be peer ids")
        for name in ("broker", "objective", "run_id"):
            value = getattr(self, name)
            _check(isinstance(value, str) and len(value) <= _MAX_TEXT, f"bad {name}")
        _check(self.objective in ("training", "inference"), f"bad objective {self.objective!r}")
        _check(is_number(self.made_at) and self.made_at >= 0, f"bad made_at {shown(self.made_at)}")
        named = [s.peer_id for g in self.groups for s in g.stages] + list(self.backups)
        _check(len(named) <= MAX_PEERS, f"a plan names at most {MAX_PEERS} peers, this one {len(named)}")
        _check(len(set(named)) == len(named), "a plan names a peer twice")
        object.__setattr__(self, "peers", tuple(sorted(named)))

    @property
    def tokens_per_s(self) -> float:
        """The plan's bound: the sum over groups of each group's bottleneck rate."""
        return sum(g.tokens_per_s for g in self.groups)

    def place_of(self, peer_id: str) -> Assignment | None:
        """Where ``peer_id`` serves in this plan (``None``: a backup, or not in the plan)."""
        for group in self.groups:
            for stage in group.stages:
                if stage.peer_id == peer_id:
                    return stage
        return None

    def group_of(self, peer_id: str) -> Group | None:
        return next((g for g in self.groups if any(s.peer_id == peer_id for s in g.stages)), None)

    def to_wire(self) -> dict[str, Any]:
        """A msgpack-friendly dict."""
        return {
            "model": self.model, "blocks": self.num_blocks, "version": self.version, "broker": self.broker,
            "made_at": self.made_at, "objective": self.objective, "run": self.run_id, "backups": list(self.backups),
            "groups": [{"s": g.seconds_per_token, "stages": [[a.peer_id, a.start, a.end] for a in g.stages]}
                       for g in self.groups],
        }

    @classmethod
    def from_wire(cls, wire: Any) -> Plan:
        """Parse a plan received from the network; ``ValueError`` if malformed. Sizes are checked before parsing."""
        _check(isinstance(wire, dict), f"a plan must be a dict, got {type(wire).__name__}")
        missing = {"model", "blocks", "version", "groups"} - wire.keys()
        _check(not missing, f"a plan lacks {sorted(missing)}")
        groups, backups = wire["groups"], wire.get("backups", [])
        _check(isinstance(groups, list) and isinstance(backups, list), "groups and backups must be lists")
        _check(all(isinstance(g, dict) and isinstance(g.get("stages"), list) for g in groups),
               "each group must be a dict with a list of stages")
        total = len(backups) + sum(len(g["stages"]) for g in groups)
        _check(total <= MAX_PEERS, f"a plan names at most {MAX_PEERS} peers, this one {total}")
        parsed = []
        for g in groups:
            rows = g["stages"]
            _check(all(isinstance(r, (list, tuple)) and len(r) == 3 for r in rows), "a stage is [peer, start, end]")
            parsed.append(Group(tuple(Assignment(*r) for r in rows), g.get("s")))
        return cls(model=wire["model"], num_blocks=wire["blocks"], version=wire["version"], groups=tuple(parsed),
                   backups=tuple(backups), broker=wire.get("broker", ""), made_at=wire.get("made_at", 0.0),
                   objective=wire.get("objective", "training"), run_id=wire.get("run", ""))


def _check(ok: Any, message: str) -> None:
    if not ok:
        raise ValueError(f"invalid plan: {message}")
