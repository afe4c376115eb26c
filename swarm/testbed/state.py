"""The state file of a testbed: every name and PID it made, written *before* it makes them, so that
``python -m swarm.testbed cleanup`` can remove a crashed run's leftovers. Also allocates each testbed's subnet."""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from swarm.testbed.procs import start_time

SUBNETS = range(100, 250)  # the second octet: testbed N uses 10.N.0.0/16 (10.N.0.0/24 the bridge, 10.N.K.0/24 NATs)


def state_dir() -> Path:
    """Where state files live: $FUSIONSWARM_TESTBED_STATE or /run/fusionswarm-testbed."""
    return Path(os.environ.get("FUSIONSWARM_TESTBED_STATE", "/run/fusionswarm-testbed"))


@dataclass
class State:
    prefix: str
    subnet: int
    owner_pid: int
    owner_start: int | None
    namespaces: list[str] = field(default_factory=list)
    nft_tables: list[list[str]] = field(default_factory=list)  # [netns, family, table]
    processes: list[list[int | None]] = field(default_factory=list)  # [pid, start time]
    workdir: str | None = None
    remove_workdir: bool = False

    @property
    def path(self) -> Path:
        return state_dir() / f"{self.prefix}.json"

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        os.replace(tmp, self.path)

    def owner_alive(self) -> bool:
        now = start_time(self.owner_pid)
        return now is not None and (self.owner_start is None or now == self.owner_start)

    @classmethod
    def load(cls, path: Path) -> State:
        return cls(**json.loads(path.read_text()))


@contextmanager
def locked() -> Iterator[Path]:
    """Hold the state directory's lock (allocation of prefixes and subnets is one at a time)."""
    folder = state_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield folder
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def all_states() -> list[State]:
    folder = state_dir()
    if not folder.is_dir():
        return []
    states = []
    for path in sorted(folder.glob("*.json")):
        try:
            states.append(State.load(path))
        except (OSError, ValueError, TypeError):
            continue
    return states


def register(prefix: str) -> State:
    """A new state file for ``prefix`` with a subnet no other recorded testbed uses."""
    with locked():
        states = all_states()
        if any(s.prefix == prefix for s in states):
            raise ValueError(f"a testbed with prefix {prefix!r} is recorded already: pick another prefix, or run "
                             "`python -m swarm.testbed cleanup` if it is a leftover")
        used = {s.subnet for s in states}
        free = [n for n in SUBNETS if n not in used]
        if not free:
            raise RuntimeError(f"all {len(SUBNETS)} testbed subnets are in use: `python -m swarm.testbed cleanup` "
                               "removes those of crashed runs")
        state = State(prefix=prefix, subnet=free[0], owner_pid=os.getpid(), owner_start=start_time(os.getpid()))
        state.save()
        return state
