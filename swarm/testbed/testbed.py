"""``Testbed``: N hosts (network namespaces) on a bridge, links shaped by a matrix, optional NAT hosts; everything
it makes is recorded in a state file first and removed on close, exception, KeyboardInterrupt or SIGTERM."""

from __future__ import annotations

import atexit
import os
import re
import secrets
import signal
import subprocess
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from swarm.testbed.cleanup import remove
from swarm.testbed.matrices import MatrixLike, resolve_matrix
from swarm.testbed.nat import NAT_TABLE, nat_ruleset
from swarm.testbed.netns import CommandError, add_netns, add_veth, in_netns, require_nft, require_root, sh
from swarm.testbed.procs import start_time
from swarm.testbed.shaping import download_commands, upload_commands
from swarm.testbed.state import State, register

MAX_HOSTS = 199  # host K has address 10.N.0.(K+1); routers of NAT hosts take 10.N.0.200 and up
MAX_NAT = 50
PREFIX = re.compile(r"^[a-z][a-z0-9]{0,15}$")


class TestbedError(RuntimeError):
    """The testbed cannot be made here; the message says what to do."""


@dataclass(frozen=True)
class Host:
    """One host: a network namespace with address ``address`` (on the bridge, or behind ``router`` for NAT)."""

    name: str
    netns: str
    address: str
    site: str
    index: int = -1  # position in ``Testbed.hosts`` (-1 for a NAT host)
    router: str | None = None  # the NAT router's namespace, for a host behind NAT
    public_address: str | None = None  # what the bridge's hosts see as its source address (the router's)


_OPEN: set[Testbed] = set()
_HANDLER_LOCK = threading.Lock()
_PREVIOUS: dict[int, Any] = {}


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    """Remove every open testbed, then let SIGTERM do what it did before (by default: end the process)."""
    close_all()
    previous = _PREVIOUS.get(signum, signal.SIG_DFL)
    signal.signal(signum, previous)
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        os.kill(os.getpid(), signum)


def close_all() -> None:
    for tb in list(_OPEN):
        tb.close()


def _install_handlers() -> None:
    with _HANDLER_LOCK:
        if _PREVIOUS or threading.current_thread() is not threading.main_thread():
            return
        _PREVIOUS[signal.SIGTERM] = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _on_sigterm)
        atexit.register(close_all)


class Testbed:
    """An emulated wide-area network on this machine (root needed). Use as a context manager.

    ``hosts`` hosts on one bridge, which lives in a namespace of its own (``PREFIX-sw``), so the root namespace's
    firewall, br_netfilter and docker rules never see the traffic and the root namespace gets no address: only
    processes started in a host (``spawn``/``run``) reach the hosts. Each testbed has its own subnet 10.N.0.0/24.
    """

    __test__ = False  # not a pytest class

    def __init__(self, hosts: int = 2, matrix: MatrixLike = "lan", prefix: str | None = None,
                 workdir: Path | str | None = None) -> None:
        if not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"hosts={hosts}: a testbed has 1 to {MAX_HOSTS} hosts")
        if prefix is not None and not PREFIX.match(prefix):
            raise ValueError(f"prefix {prefix!r}: use 1-16 lower-case letters and digits, starting with a letter")
        self.n, self.matrix = hosts, resolve_matrix(matrix)
        self.prefix = prefix or f"tb{secrets.token_hex(4)}"
        self._workdir_arg = Path(workdir) if workdir is not None else None
        self.hosts: list[Host] = []
        self.nat_hosts: list[Host] = []
        self.state: State | None = None
        self.workdir = Path()
        self._up: dict[str, float | None] = {}
        self._down: dict[str, float | None] = {}
        self._handles: list[subprocess.Popen] = []
        self._leaf: dict[tuple[str, str], str] = {}  # (sender name, destination address) -> htb classid
        self._lock = threading.RLock()

    # ---- life cycle --------------------------------------------------------------------------------------
    def __enter__(self) -> Testbed:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> Testbed:
        reason = require_root()
        if reason:
            raise TestbedError(f"cannot make a testbed: {reason}")
        self.state = register(self.prefix)
        _OPEN.add(self)
        _install_handlers()
        try:
            self._make_workdir()
            self._make_bridge()
            for i in range(self.n):
                self._make_host(i)
            for host in self.hosts:
                self._shape(host)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop every process, remove every namespace (with its veths, bridge and nft tables) and the state file."""
        with self._lock:
            if self.state is None:
                return
            state, self.state = self.state, None
            failed = remove(state)
            for handle in self._handles:
                try:
                    handle.wait(1)
                except subprocess.TimeoutExpired:
                    pass
            self._handles.clear()
            _OPEN.discard(self)
            if failed:
                raise TestbedError(f"could not delete namespaces {failed}: see `ip netns pids NAME`, then run "
                                   "`python -m swarm.testbed cleanup`")

    @property
    def subnet(self) -> int:
        return self._state().subnet

    def _state(self) -> State:
        if self.state is None:
            raise TestbedError("this testbed is not running: use it inside `with Testbed(...) as tb:`")
        return self.state

    def _record_netns(self, name: str) -> str:
        state = self._state()
        state.namespaces.append(name)
        state.save()
        add_netns(name)
        return name

    def _make_workdir(self) -> None:
        state = self._state()
        if self._workdir_arg is None:
            self.workdir = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-"))
            state.remove_workdir = True
        else:
            self.workdir = self._workdir_arg
            self.workdir.mkdir(parents=True, exist_ok=True)
        state.workdir = str(self.workdir)
        state.save()

    def _make_bridge(self) -> None:
        sw = self._record_netns(f"{self.prefix}-sw")
        sh(["ip", "link", "add", "br0", "type", "bridge"], netns=sw)
        # a fresh namespace has no firewall rules; br_netfilter would still hand bridged frames to (empty) tables
        sh(["sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=0"], netns=sw, check=False)
        sh(["ip", "link", "set", "br0", "up"], netns=sw)

    def _switch(self) -> str:
        return f"{self.prefix}-sw"

    def _attach(self, netns: str, port: str, address: str) -> None:
        """A veth from ``netns`` (eth0, with ``address``/24) to bridge port ``port``."""
        add_veth(netns, "eth0", self._switch(), port)
        sh(["ip", "link", "set", port, "master", "br0", "up"], netns=self._switch())
        sh(["ip", "addr", "add", f"{address}/24", "dev", "eth0"], netns=netns)
        sh(["ip", "link", "set", "eth0", "up"], netns=netns)

    def _make_host(self, i: int) -> None:
        netns = self._record_netns(f"{self.prefix}-h{i}")
        address = f"10.{self.subnet}.0.{i + 1}"
        self._attach(netns, f"h{i}", address)
        host = Host(f"h{i}", netns, address, self.matrix.site(i, self.n), index=i)
        self.hosts.append(host)
        self._up[host.name] = self.matrix.up(i, self.n)
        self._down[host.name] = self.matrix.down(i, self.n)

    def _shape(self, host: Host) -> None:
        i = host.index
        pairs: dict[str, float] = {}
        for other in self.hosts:
            if other.index != i:
                rate = self.matrix.pair(i, other.index, self.n)
                if rate is not None:
                    pairs[other.address] = float(rate)
        for argv in upload_commands("eth0", self._up[host.name], pairs):
            sh(argv, netns=host.netns)
            if argv[:2] == ["tc", "filter"]:  # ... match ip dst ADDRESS/32 flowid CLASSID
                self._leaf[(host.name, argv[-3].split("/")[0])] = argv[-1]
        for argv in download_commands(f"h{i}", self._down[host.name]):
            sh(argv, netns=self._switch())

    # ---- what it is ----------------------------------------------------------------------------------------
    def host(self, name: str) -> Host:
        for host in [*self.hosts, *self.nat_hosts]:
            if host.name == name:
                return host
        raise KeyError(f"no host {name!r}: this testbed has {[h.name for h in self.hosts + self.nat_hosts]}")

    def rate(self, src: Host, dst: Host) -> float:
        """Configured bits/s from ``src`` to ``dst`` (``inf`` where nothing shapes the path)."""
        if src == dst:
            raise ValueError(f"{src.name} to itself is not a link")
        pair = (self.matrix.pair(src.index, dst.index, self.n)
                if src.index >= 0 and dst.index >= 0 else None)
        rates = [r for r in (pair, self._up[src.name], self._down[dst.name]) if r is not None]
        return float(min(rates)) if rates else float("inf")

    def sent_bytes(self, src: Host, dst: Host) -> int:
        """Bytes ``src``'s shaper has sent so far in the class that carries its traffic to ``dst`` (the default
        class, shared with other destinations, where the pair has no class of its own; 0 where nothing shapes)."""
        classid = self._leaf.get((src.name, dst.address), "1:fffe")
        out = sh(["tc", "-s", "class", "show", "dev", "eth0", "classid", classid], netns=src.netns).stdout
        match = re.search(r"Sent (\d+) bytes", out)
        return int(match.group(1)) if match else 0

    def describe(self) -> dict:
        """Hosts, addresses and configured rates (JSON-ready; ``null`` for an unshaped pair)."""
        everyone = [*self.hosts, *self.nat_hosts]

        def bits(r: float) -> float | None:
            return None if r == float("inf") else r

        return {
            "prefix": self.prefix, "subnet": f"10.{self.subnet}.0.0/24", "matrix": self.matrix.name,
            "matrix_description": self.matrix.description,
            "hosts": [{"name": h.name, "netns": h.netns, "address": h.address, "site": h.site,
                       **({"router": h.router, "public_address": h.public_address} if h.router else {})}
                      for h in everyone],
            "rates_bits_per_s": {a.name: {b.name: bits(self.rate(a, b)) for b in everyone if b != a}
                                 for a in everyone},
        }

    # ---- processes -------------------------------------------------------------------------------------------
    def popen(self, host: Host, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """``subprocess.Popen`` of ``argv`` inside ``host``, in its own process group, recorded by PID."""
        state = self._state()
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        with self._lock:
            handle = subprocess.Popen([*in_netns(host.netns), *argv], start_new_session=True, **kwargs)
            state.processes.append([handle.pid, start_time(handle.pid)])
            state.save()
            self._handles.append(handle)
        return handle

    def spawn(self, host: Host, argv: Sequence[str], name: str | None = None, log: Path | str | None = None,
              env: Mapping[str, str] | None = None, cwd: Path | str | None = None) -> subprocess.Popen:
        """Start ``argv`` in ``host`` with stdout+stderr to ``log`` (default ``workdir/logs/NAME.log``); it is
        stopped on close (SIGTERM, then SIGKILL to its group). The handle has ``name`` and ``log_path``."""
        name = name or f"{host.name}-{len(self._handles)}"
        log_path = Path(log) if log is not None else self.workdir / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as out:
            handle = self.popen(host, argv, stdout=out, stderr=subprocess.STDOUT,
                                env=dict(env) if env is not None else None, cwd=cwd)
        handle.name, handle.log_path = name, log_path  # type: ignore[attr-defined]
        return handle

    def run(self, host: Host, argv: Sequence[str], check: bool = True, timeout: float = 60.0,
            **kwargs: Any) -> subprocess.CompletedProcess:
        """``subprocess.run`` of ``argv`` inside ``host``, output captured as text; raises on a non-zero exit with
        the command's stderr."""
        self._state()
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        done = subprocess.run([*in_netns(host.netns), *argv], timeout=timeout, **kwargs)
        if check and done.returncode != 0:
            raise subprocess.CalledProcessError(done.returncode, done.args, done.stdout, done.stderr)
        return done

    # ---- NAT ------------------------------------------------------------------------------------------------
    def add_nat_host(self, up: float | None = None, down: float | None = None) -> Host:
        """A host behind a router namespace that masquerades with nftables: it can dial the bridge's hosts,
        they cannot dial it. ``up``/``down`` (bits/s) shape the router's link to the bridge."""
        reason = require_nft()
        if reason:
            raise TestbedError(f"cannot add a NAT host: {reason}")
        k = len(self.nat_hosts)
        if k >= MAX_NAT:
            raise ValueError(f"a testbed has at most {MAX_NAT} NAT hosts")
        state = self._state()
        router = f"{self.prefix}-r{k}"
        inside = f"{self.prefix}-n{k}"
        state.nft_tables.append([router, "ip", NAT_TABLE])
        self._record_netns(router)
        self._record_netns(inside)
        public = f"10.{self.subnet}.0.{200 + k}"
        gateway, address = f"10.{self.subnet}.{k + 1}.1", f"10.{self.subnet}.{k + 1}.2"
        self._attach(router, f"r{k}", public)
        add_veth(inside, "eth0", router, "lan0")
        sh(["ip", "addr", "add", f"{gateway}/24", "dev", "lan0"], netns=router)
        sh(["ip", "link", "set", "lan0", "up"], netns=router)
        sh(["ip", "addr", "add", f"{address}/24", "dev", "eth0"], netns=inside)
        sh(["ip", "link", "set", "eth0", "up"], netns=inside)
        sh(["ip", "route", "add", "default", "via", gateway], netns=inside)
        sh(["sysctl", "-qw", "net.ipv4.ip_forward=1"], netns=router)
        try:
            sh(["nft", "-f", "-"], netns=router, input=nat_ruleset("eth0", "lan0"))
        except CommandError as e:
            raise TestbedError(f"nftables refused the NAT ruleset ({e}); check `nft --version` (>= 0.9.3)") from e
        host = Host(f"nat{k}", inside, address, "nat", router=router, public_address=public)
        for argv in upload_commands("eth0", up, {}):
            sh(argv, netns=router)
        for argv in download_commands(f"r{k}", down):
            sh(argv, netns=self._switch())
        self._up[host.name], self._down[host.name] = up, down
        self.nat_hosts.append(host)
        return host
