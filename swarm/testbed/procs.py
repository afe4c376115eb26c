"""Processes started in testbed hosts: identified by PID and start time (so a reused PID is never signalled)."""

from __future__ import annotations

import os
import signal
import time


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2:].split()
    if fields and fields[0] == "Z":
        return None  # a zombie is as good as gone
    return int(fields[19]) if len(fields) > 19 else None


def same_process(pid: int, started: int | None) -> bool:
    """Whether ``pid`` is still the process that started at ``started``."""
    now = start_time(pid)
    return now is not None and (started is None or now == started)


def signal_group(pid: int, started: int | None, sig: int) -> bool:
    """Send ``sig`` to the process group led by ``pid`` if the leader is still that process; True if sent."""
    if not same_process(pid, started):
        return False
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
    return True


def signal_leader(pid: int, started: int | None, sig: int) -> bool:
    """Send ``sig`` to ``pid`` alone if it is still that process; True if sent."""
    if not same_process(pid, started):
        return False
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def kill_pids(pids: list[int]) -> None:
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def wait_gone(pids: list[tuple[int, int | None]], timeout: float) -> bool:
    """Wait until none of ``pids`` (pid, start time) runs any more; True if they all ended."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [(p, s) for p, s in pids if same_process(p, s)]
        if not alive:
            return True
        if time.monotonic() >= deadline:
            return False
        for p, _ in alive:
            try:  # reap our own children so they do not linger as zombies
                os.waitpid(p, os.WNOHANG)
            except ChildProcessError:
                pass
        time.sleep(0.05)
