"""Removing what a testbed made, by the names and PIDs its state file recorded: processes first (their groups,
then anything else still inside its namespaces), nft tables, namespaces (their veths and bridge go with them)."""

from __future__ import annotations

import shutil
import signal
from collections.abc import Sequence

from swarm.testbed.netns import NETNS_DIR, delete_netns, netns_exists, pids_in_netns, sh
from swarm.testbed.procs import kill_pids, signal_group, signal_leader, start_time, wait_gone
from swarm.testbed.state import State, all_states


def stop_processes(state: State, grace: float = 5.0) -> None:
    """SIGTERM each recorded process (a peer then stops its own p2p daemon), wait up to ``grace`` s, then
    SIGKILL the groups and every process left in the testbed's namespaces."""
    procs = [(int(p), s) for p, s in state.processes if p is not None]
    sent = [(p, s) for p, s in procs if signal_leader(p, s, signal.SIGTERM)]
    if sent:
        wait_gone(sent, grace)
    for p, s in procs:
        signal_group(p, s, signal.SIGKILL)
    for _ in range(20):  # children that left the group but not the namespace
        left = [pid for ns in state.namespaces for pid in pids_in_netns(ns)]
        if not left:
            break
        kill_pids(left)
        wait_gone([(p, None) for p in left], 0.5)


def remove(state: State, grace: float = 5.0) -> list[str]:
    """Remove everything ``state`` recorded; returns what could not be removed (empty when all went)."""
    stop_processes(state, grace)
    for ns, family, table in state.nft_tables:
        if netns_exists(ns):
            sh(["nft", "delete", "table", family, table], netns=ns, check=False)
    for ns in reversed(state.namespaces):
        delete_netns(ns)
    failed = [ns for ns in state.namespaces if netns_exists(ns)]
    if state.remove_workdir and state.workdir:
        shutil.rmtree(state.workdir, ignore_errors=True)
    if not failed:
        state.path.unlink(missing_ok=True)
    return failed


def cleanup_leftovers(force: bool = False, prefix: str | None = None) -> list[dict]:
    """Remove testbeds whose owning process is gone (or every one with ``force``; only ``prefix`` if given)."""
    report: list[dict] = []
    for state in all_states():
        if prefix is not None and state.prefix != prefix:
            continue
        if state.owner_alive() and not force:
            report.append({"prefix": state.prefix, "action": "kept",
                           "why": f"its owner (pid {state.owner_pid}) still runs; --force removes it anyway"})
            continue
        failed = remove(state, grace=2.0)
        report.append({"prefix": state.prefix, "action": "removed" if not failed else "partly removed",
                       "namespaces": state.namespaces, "failed": failed})
    return report


def leftovers(prefix: str, pids: Sequence[int] = ()) -> dict[str, list]:
    """What of testbed ``prefix`` still exists here: ``/run/netns`` entries, ``ip netns list`` lines, root-namespace
    links, its state file, root-namespace nft tables naming it, and which of ``pids`` still run. All lists are
    empty when everything is gone (``nothing_left``)."""
    netns = sorted(p.name for p in NETNS_DIR.glob(f"{prefix}-*")) if NETNS_DIR.is_dir() else []
    listed = sh(["ip", "netns", "list"]).stdout.splitlines()
    found: dict[str, list] = {
        "netns": netns,
        "ip_netns_list": [line for line in listed if line.startswith(f"{prefix}-")],
        "links": [line for line in sh(["ip", "-o", "link"]).stdout.splitlines() if prefix in line],
        "states": [s.prefix for s in all_states() if s.prefix == prefix],
        "pids": [p for p in pids if start_time(p) is not None],
    }
    if shutil.which("nft"):  # the NAT tables live in router namespaces; none is ever made in the root one
        found["nft_tables"] = [t for t in sh(["nft", "list", "tables"], check=False).stdout.splitlines() if prefix in t]
    return found


def nothing_left(found: dict[str, list]) -> bool:
    return not any(found.values())
