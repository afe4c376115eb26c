"""Network namespaces, veth pairs and the processes inside a namespace, through ``ip`` (iproute2)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

NETNS_DIR = Path("/run/netns")


class CommandError(RuntimeError):
    """A setup command failed; the message has the command and its stderr."""


def sh(argv: Sequence[str], netns: str | None = None, check: bool = True, timeout: float = 30.0,
       input: str | None = None) -> subprocess.CompletedProcess:
    """Run ``argv`` (inside ``netns`` if given), captured; raise ``CommandError`` with its stderr on failure."""
    if netns and argv and argv[0] in ("ip", "tc"):
        full = [argv[0], "-n", netns, *argv[1:]]  # no mount namespace to set up: faster than `ip netns exec`
    else:
        full = [*in_netns(netns), *argv]
    done = subprocess.run(full, capture_output=True, text=True, timeout=timeout, input=input,
                          stdin=None if input is not None else subprocess.DEVNULL)
    if check and done.returncode != 0:
        raise CommandError(f"`{' '.join(full)}` failed (exit {done.returncode}): {done.stderr.strip()}")
    return done


def in_netns(netns: str | None) -> list[str]:
    """The argv prefix that runs a command inside ``netns`` (nothing for the root namespace)."""
    return ["ip", "netns", "exec", netns] if netns else []


def add_netns(name: str) -> None:
    if netns_exists(name):
        raise CommandError(f"network namespace {name} exists already: another testbed uses this prefix, or a "
                           "crashed run left it (`python -m swarm.testbed cleanup`)")
    sh(["ip", "netns", "add", name])
    sh(["ip", "link", "set", "lo", "up"], netns=name)


def netns_exists(name: str) -> bool:
    return (NETNS_DIR / name).exists()


def delete_netns(name: str) -> None:
    """Delete ``name`` (its veths go with it); no error if it is already gone."""
    if netns_exists(name):
        sh(["ip", "netns", "delete", name], check=False)


def add_veth(a_ns: str, a_dev: str, b_ns: str, b_dev: str) -> None:
    """A veth pair created straight inside two namespaces (never visible in the root namespace)."""
    sh(["ip", "link", "add", a_dev, "netns", a_ns, "type", "veth", "peer", "name", b_dev, "netns", b_ns])


def pids_in_netns(name: str) -> list[int]:
    """Every process whose network namespace is ``name`` (what ``ip netns pids`` prints), read from /proc."""
    try:
        target = os.stat(NETNS_DIR / name)
    except FileNotFoundError:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry}/ns/net")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
            found.append(int(entry))
    return found


def missing_tools() -> list[str]:
    return [tool for tool in ("ip", "tc") if shutil.which(tool) is None]


def require_root() -> str | None:
    """Why namespace tests cannot run here (a reason for ``pytest.skip``), or None when they can."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (run as root; CI does)"
    missing = missing_tools()
    if missing:
        return f"needs iproute2's {' and '.join(missing)}: apt-get install -y iproute2"
    return None


def require_nft() -> str | None:
    """Why the NAT host cannot be made here, or None."""
    reason = require_root()
    if reason:
        return reason
    if shutil.which("nft") is None:
        return "the NAT host needs nftables: apt-get install -y nftables (`make install` does it when root)"
    return None
