"""Start and stop real ``swarm`` processes on this machine: used by the demo, the tests and the benchmarks.

Each process runs in its own session (process group), so that stopping it also stops the p2p daemon it
spawned; every process is tracked by PID and stopped by ``LocalSwarm.close()``, also after a failure.

A process may run inside a network namespace (``netns``: ``ip netns exec NETNS python -m peers.cli ...``), e.g. a host
of ``swarm.testbed``; ``LocalSwarm``'s ``host=`` (anything with ``.netns`` and ``.address``, such as a testbed
``Host``) places a process there and has it listen on ``/ip4/ADDRESS/tcp/0`` instead of 127.0.0.1.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from peers.core.config import SwarmConfig
from privacy.identity import Identity
from privacy.membership import SwarmOwner
from privacy.peer_ids import peer_id_of

READY_PEER = re.compile(r"Serving blocks (\d+):(\d+) of \S+ as peer (\w+)")
READY_GRAPH = re.compile(r"Serving graph nodes (\d+):(\d+) of \S+ .* as peer (\w+)")
READY_BACKUP = re.compile(r"Backup peer (\w+) of \S+ ready")
READY_DHT = re.compile(r"--initial_peers (.+)$", re.MULTILINE)
READY_MONITOR = re.compile(r"Monitor at (http://\S+/) ")
LOOPBACK = "127.0.0.1"


class Placement(Protocol):
    """Where a process runs: a network namespace and the address it listens on there (a testbed ``Host``)."""

    @property
    def netns(self) -> str: ...

    @property
    def address(self) -> str: ...


def netns_prefix(netns: str | None) -> list[str]:
    """The argv prefix that runs a command inside ``netns`` (nothing for this namespace)."""
    return ["ip", "netns", "exec", netns] if netns else []


class SwarmProcess:
    """One ``swarm ...`` subprocess whose output goes to a log file (inside network namespace ``netns`` if given)."""

    def __init__(self, args: Sequence[str], log_path: Path, name: str, netns: str | None = None) -> None:
        self.name, self.log_path, self.netns, self.args = name, Path(log_path), netns, tuple(args)
        self.bootstrap = bool(args) and args[0] == "dht"  # a ``swarm dht`` process: stopped after the others
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen(
                [*netns_prefix(netns), sys.executable, "-m", "peers.cli", *args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )
        self.pid = self.popen.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_for(self, pattern: re.Pattern, timeout: float) -> re.Match:
        """Wait until the log matches ``pattern``; raise with the log's tail if the process dies or stalls."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = pattern.search(self.log())
            if match:
                return match
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.popen.returncode}:\n{self._tail()}")
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} was not ready after {timeout:.0f} s:\n{self._tail()}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the whole process group (the peer and its p2p daemon)."""
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (a clean leave), then SIGKILL for whatever is left of the group."""
        stop_all([self], timeout)

    def terminate(self) -> None:
        """SIGTERM to the process only (it stops its own daemon after leaving), and SIGCONT so that a stopped one
        (SIGSTOP, a test's frozen peer) gets it now rather than a SIGKILL after the timeout; nothing if it exited."""
        if self.popen.poll() is None:
            try:
                os.kill(self.pid, signal.SIGTERM)
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def reap(self, deadline: float) -> None:
        """Wait for the process until ``deadline`` (``time.monotonic()``), then SIGKILL what is left of its group."""
        try:
            self.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        self.kill(signal.SIGKILL)
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def _tail(self, lines: int = 30) -> str:
        return "\n".join(self.log().splitlines()[-lines:])


class LocalSwarm:
    """A bootstrap peer plus stage peers on 127.0.0.1; a context manager that stops all of them.

    Processes find each other through ``initial_peers`` only (the bootstrap peer runs with ``--no_mdns``), so that
    several swarms on one machine stay apart; with ``lan``, peers started before any bootstrap peer get no
    ``--initial_peers`` and find each other on the LAN (mDNS, ``swarm.lan``).

    With ``train``, every peer allows the swarm's trainer (``--trainers``, the peer id of ``trainer_config()``'s
    identity file) unless ``start_peer(trainers=...)`` says otherwise; without it, peers train for nobody.
    """

    probe_max_mib: float | None = None  # stage peers' --probe_max_mib (None: theirs); the tests set 1 (loopback)

    def __init__(self, workdir: Path, *, update_period: float = 2.0, num_threads: int | None = 1,
                 private: bool = False, train: bool = False, lan: bool = False) -> None:
        self.workdir = Path(workdir)
        self.update_period, self.num_threads, self.train, self.lan = update_period, num_threads, train, lan
        self.processes: list[SwarmProcess] = []
        self.initial_peers: list[str] = []
        self.owner = SwarmOwner.generate() if private else None  # a private swarm: every process is invited

    def member_flags(self, name: str, ttl: float = 86400.0) -> list[str]:
        """``--identity_path`` and ``--private`` flags of a new member ``name`` (none in a public swarm)."""
        if self.owner is None:
            return []
        identity_path, credentials_path = self.member_files(name, ttl)
        return ["--identity_path", str(identity_path), "--private", str(credentials_path)]

    def member_files(self, name: str, ttl: float = 86400.0) -> tuple[Path, Path]:
        """Create member ``name``'s identity and have the owner invite it: (identity file, credentials file)."""
        if self.owner is None:
            raise RuntimeError("a public swarm has no members: make the LocalSwarm with private=True")
        folder = self.workdir / "members"
        identity = Identity.load_or_create(folder / f"{name}.id")
        self.owner.invite(identity.public_bytes, name, ttl).save(folder / f"{name}.member", overwrite=True)
        return folder / f"{name}.id", folder / f"{name}.member"

    def swarm_config(self, name: str = "client", ttl: float = 86400.0) -> SwarmConfig:
        """How an in-process client joins this swarm (as invited member ``name`` if the swarm is private)."""
        if self.owner is None:
            return SwarmConfig(initial_peers=tuple(self.initial_peers))
        identity_path, credentials_path = self.member_files(name, ttl)
        return SwarmConfig(initial_peers=tuple(self.initial_peers), identity_path=identity_path,
                           credentials_path=credentials_path)

    def trainer_identity(self, name: str = "trainer") -> Path:
        """The identity file of trainer ``name`` (an invited member's in a private swarm), created if missing."""
        if self.owner is not None:
            return self.member_files(name)[0]
        path = self.workdir / "trainers" / f"{name}.id"
        Identity.load_or_create(path)
        return path

    def trainer_id(self, name: str = "trainer") -> str:
        """Trainer ``name``'s peer id: what peers that let it train get in ``--trainers``."""
        return peer_id_of(Identity.load_or_create(self.trainer_identity(name)).public_bytes)

    def trainer_config(self, name: str = "trainer") -> SwarmConfig:
        """How an in-process trainer joins as trainer ``name`` (its fixed identity, and invite if private)."""
        if self.owner is not None:
            return self.swarm_config(name)
        return SwarmConfig(initial_peers=tuple(self.initial_peers), identity_path=self.trainer_identity(name))

    def trainer_flags(self, name: str = "trainer") -> list[str]:
        """``--identity_path`` (and ``--private``) of trainer ``name``, for a ``swarm train`` process."""
        if self.owner is not None:
            return self.member_flags(name)
        return ["--identity_path", str(self.trainer_identity(name))]

    def start_dht(self, timeout: float = 60.0, host: Placement | None = None) -> list[str]:
        """The bootstrap peer (in ``host`` if given, listening on its address); returns ``initial_peers``."""
        address = host.address if host is not None else LOOPBACK
        proc = self._spawn(["dht", "--host_maddrs", f"/ip4/{address}/tcp/0", *self.member_flags("dht"),
                            *([] if self.lan else ["--no_mdns"])], "dht", host)
        line = proc.wait_for(READY_DHT, timeout).group(1)
        self.initial_peers = [m for m in line.split() if m.startswith(f"/ip4/{address}/")] or line.split()
        return self.initial_peers

    def start_peer(
        self,
        model_dir: Path,
        *,
        block_indices: str | None = None,
        num_blocks: int | None = None,
        extra: Sequence[str] = (),
        name: str | None = None,
        wait: bool = True,
        timeout: float = 120.0,
        trainers: str | None = None,
        host: Placement | None = None,
    ) -> SwarmProcess:
        """A stage peer; ``trainers`` is its ``--trainers`` (None: the swarm's trainer with ``train``, else none;
        "": none); in ``host`` if given, listening on ``/ip4/ADDRESS/tcp/0`` (unless ``extra`` has
        ``--host_maddrs``)."""
        if not self.initial_peers and not self.lan:
            raise RuntimeError("call start_dht() first (or make the LocalSwarm with lan=True)")
        blocks = ["--block_indices", block_indices] if block_indices else \
            ["--num_blocks", str(num_blocks)] if num_blocks is not None else []  # none: --backup in extra
        if trainers is None:
            trainers = self.trainer_id() if self.train else ""
        args = [
            "peer", str(model_dir), *(["--initial_peers", *self.initial_peers] if self.initial_peers else []), *blocks,
            "--update_period", str(self.update_period), "--cache_dir", str(self.workdir / "cache"),
            *(["--num_threads", str(self.num_threads)] if self.num_threads else []),
            *(["--trainers", trainers] if trainers else []), *host_flags(host, extra),
            *(["--probe_max_mib", f"{self.probe_max_mib:g}"] if self.probe_max_mib and "--probe_max_mib" not in extra
              else []), *extra,
        ]
        name = name or f"peer{len(self.processes)}"
        proc = self._spawn([*args, *self.member_flags(name)], name, host)
        if wait:
            self.wait_ready(proc, timeout)
        return proc

    def start_graph_peer(self, arch: str, *, nodes: str | None = None, stage: str | None = None,
                         extra: Sequence[str] = (), name: str | None = None, wait: bool = True,
                         timeout: float = 120.0, trainers: str | None = None,
                         host: Placement | None = None) -> SwarmProcess:
        """A peer serving a stage of an operator graph (``swarm peer --graph ARCH``): nodes ``A:B`` or stage
        ``I/N``; ``extra`` passes its config and inputs (``--graph_config``, ``--graph_inputs``...); in ``host``
        as for ``start_peer``."""
        if trainers is None:
            trainers = self.trainer_id() if self.train else ""
        where = ["--graph_nodes", nodes] if nodes else ["--graph_stage", stage] if stage else []
        args = ["peer", "--graph", arch, *where, "--initial_peers", *self.initial_peers,
                "--update_period", str(self.update_period),
                *(["--num_threads", str(self.num_threads)] if self.num_threads else []),
                *(["--trainers", trainers] if trainers else []), *host_flags(host, extra), *extra]
        name = name or f"graph{len(self.processes)}"
        proc = self._spawn([*args, *self.member_flags(name)], name, host)
        if wait:
            self.wait_graph_ready(proc, timeout)
        return proc

    @staticmethod
    def wait_graph_ready(proc: SwarmProcess, timeout: float = 120.0) -> tuple[int, int, str]:
        """Wait for a graph peer's ready line: its node range and peer id."""
        match = proc.wait_for(READY_GRAPH, timeout)
        proc.blocks, proc.peer_id = (int(match.group(1)), int(match.group(2))), match.group(3)
        return proc.blocks[0], proc.blocks[1], proc.peer_id

    def start_monitor(self, models: Sequence[str | Path], *, refresh: float = 1.0, extra: Sequence[str] = (),
                      timeout: float = 60.0) -> tuple[SwarmProcess, str]:
        """``swarm monitor`` of ``models`` on a free port of 127.0.0.1 (a member's credentials in a private swarm):
        the process and the page's URL."""
        proc = self._spawn(["monitor", *map(str, models), "--initial_peers", *self.initial_peers, "--port", "0",
                            "--refresh", str(refresh), *self.member_flags("monitor"), *extra], "monitor")
        return proc, proc.wait_for(READY_MONITOR, timeout).group(1)

    @staticmethod
    def wait_ready(proc: SwarmProcess, timeout: float = 120.0) -> tuple[int, int, str]:
        """Wait for a peer's ready line: its span and peer id (a backup's span is (0, 0): it serves none)."""
        if "--backup" in proc.args:
            proc.blocks, proc.peer_id = (0, 0), proc.wait_for(READY_BACKUP, timeout).group(1)
            return 0, 0, proc.peer_id
        match = proc.wait_for(READY_PEER, timeout)
        proc.blocks = (int(match.group(1)), int(match.group(2)))
        proc.peer_id = match.group(3)
        return int(match.group(1)), int(match.group(2)), match.group(3)

    def close(self) -> None:
        """Stop every process: the stage peers (and other clients) together, then the bootstrap peers, through which
        the others announce that they leave. Together: each process's exit costs a second or more of CPU."""
        procs = list(reversed(self.processes))
        stop_all([p for p in procs if not p.bootstrap])
        stop_all([p for p in procs if p.bootstrap])
        self.processes.clear()

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _spawn(self, args: list[str], name: str, host: Placement | None = None) -> SwarmProcess:
        proc = SwarmProcess(args, self.workdir / "logs" / f"{name}.log", name,
                            netns=host.netns if host is not None else None)
        self.processes.append(proc)
        return proc


def stop_all(procs: Sequence[SwarmProcess], timeout: float = 10.0) -> None:
    """SIGTERM every process at once (a clean leave), wait up to ``timeout`` for all, then SIGKILL what is left."""
    for proc in procs:
        proc.terminate()
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.reap(deadline)


def host_flags(host: Placement | None, extra: Sequence[str] = ()) -> list[str]:
    """``--host_maddrs /ip4/ADDRESS/tcp/0`` for a process placed in ``host`` (none if ``extra`` sets its own)."""
    if host is None or "--host_maddrs" in extra:
        return []
    return ["--host_maddrs", f"/ip4/{host.address}/tcp/0"]
