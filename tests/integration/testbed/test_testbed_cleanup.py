"""Everything a testbed makes is removed: on a normal exit, when the body raises, on SIGTERM and Ctrl-C, and by
``python -m swarm.testbed cleanup`` after a SIGKILL; a live testbed is never touched by that command."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarm.testbed import Testbed
from swarm.testbed.cleanup import leftovers, nothing_left
from swarm.testbed.netns import pids_in_netns

HOLD = Path(__file__).with_name("hold_testbed.py")


def _names_and_pids(tb: Testbed) -> list[int]:
    return sorted({pid for ns in tb.state.namespaces for pid in pids_in_netns(ns)})


def test_normal_exit_removes_everything(tmp_path, needs_nft):
    with Testbed(3, "home", workdir=tmp_path) as tb:
        nat = tb.add_nat_host()
        tb.spawn(tb.hosts[1], ["sleep", "1000"], name="sleeper")
        tb.spawn(nat, ["sh", "-c", "setsid sleep 1000 & sleep 1000"], name="escaper")
        tb.run(tb.hosts[0], ["true"])
        prefix = tb.prefix
        assert len(tb.state.namespaces) == 6  # switch, 3 hosts, router, NAT host
        time.sleep(0.3)
        pids = _names_and_pids(tb)
        assert len(pids) >= 4  # sleeper, sh, the sleep that left the group, the group's own sleep
        found = leftovers(prefix, pids)
        assert len(found["netns"]) == 6 and found["states"] == [prefix]
    assert nothing_left(leftovers(prefix, pids)), leftovers(prefix, pids)
    assert (tmp_path / "logs" / "sleeper.log").exists()  # a given workdir is kept


def test_an_exception_in_the_body_removes_everything():
    with pytest.raises(RuntimeError, match="the body failed"):
        with Testbed(2, "lan") as tb:
            prefix, workdir = tb.prefix, tb.workdir
            tb.spawn(tb.hosts[0], ["sleep", "1000"])
            pids = _names_and_pids(tb)
            raise RuntimeError("the body failed")
    assert nothing_left(leftovers(prefix, pids)), leftovers(prefix, pids)
    assert not workdir.exists()  # a workdir the testbed made is removed too


def _hold() -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, str(HOLD)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        pytest.fail(f"hold_testbed.py did not start: {proc.communicate()[1][-2000:]}")
    info = json.loads(line)
    assert nothing_left(leftovers(info["prefix"])) is False
    return proc, info


def _cleanup(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swarm.testbed", "cleanup", *args], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, -signal.SIGINT)])
def test_sigterm_and_ctrl_c_remove_everything(sig, code, needs_nft):
    proc, info = _hold()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err[-2000:]
    if sig == signal.SIGINT:
        assert "interrupted" in out and "KeyboardInterrupt" in err
    assert nothing_left(leftovers(info["prefix"], info["pids"])), leftovers(info["prefix"], info["pids"])


def test_cleanup_command_removes_a_sigkilled_run_and_keeps_live_ones(needs_nft):
    proc, info = _hold()
    kept = _cleanup("--prefix", info["prefix"])  # the owner still runs: hands off
    assert kept.returncode == 0 and '"kept"' in kept.stdout, kept.stdout + kept.stderr
    assert len(leftovers(info["prefix"])["netns"]) == len(info["namespaces"])

    proc.kill()
    proc.wait(10)
    found = leftovers(info["prefix"], info["pids"])
    assert len(found["netns"]) == len(info["namespaces"]) and found["pids"], found  # SIGKILL left it all
    done = _cleanup("--prefix", info["prefix"])
    assert done.returncode == 0 and '"removed"' in done.stdout, done.stdout + done.stderr
    assert nothing_left(leftovers(info["prefix"], info["pids"])), leftovers(info["prefix"], info["pids"])
    again = _cleanup("--prefix", info["prefix"])
    assert again.returncode == 0 and "nothing to clean up" in again.stdout
