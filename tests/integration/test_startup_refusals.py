"""Real ``swarm`` processes on 127.0.0.1 that must refuse to start (a taken port, an identity already in use),
and a clean stop that leaves nothing unretrieved in the log."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from peers.cli.launch import READY_DHT, READY_PEER, LocalSwarm, SwarmProcess, stop_all

UNRETRIEVED = "exception was never retrieved"


@pytest.fixture
def spawned(tmp_path) -> Iterator[list[SwarmProcess]]:
    """Processes a test starts by hand; all are stopped afterwards, also on failure."""
    procs: list[SwarmProcess] = []
    try:
        yield procs
    finally:
        for proc in reversed(procs):
            proc.stop()


@pytest.fixture(scope="module")
def shared_dht(tmp_path_factory) -> Iterator[LocalSwarm]:
    with LocalSwarm(tmp_path_factory.mktemp("refusals"), update_period=1.0) as swarm:
        swarm.start_dht()
        yield swarm


@pytest.fixture
def dht_swarm(shared_dht) -> Iterator[LocalSwarm]:
    """The module's bootstrap peer, for tests that leave it running; the peers a test starts stop after it."""
    before = len(shared_dht.processes)
    yield shared_dht
    stop_all(shared_dht.processes[before:])
    del shared_dht.processes[before:]


def spawn(procs: list[SwarmProcess], tmp_path: Path, name: str, *args: str) -> SwarmProcess:
    proc = SwarmProcess(list(args), tmp_path / "logs" / f"{name}.log", name)
    procs.append(proc)
    return proc


def outcome(proc: SwarmProcess, ready: re.Pattern, limit: float = 120.0) -> int | None:
    """The exit code if ``proc`` exits before its log shows ``ready``; None if it got ready (started)."""
    deadline = time.monotonic() + limit  # a guard against hanging, not an assertion on time
    while time.monotonic() < deadline:
        code = proc.popen.poll()
        if code is not None:
            return code
        if ready.search(proc.log()):
            return None
        time.sleep(0.1)
    raise AssertionError(f"{proc.name} neither started nor exited:\n{proc.log()}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_cleanly(proc: SwarmProcess) -> str:
    os.kill(proc.pid, signal.SIGTERM)  # the process only: it stops its own daemon
    assert proc.popen.wait(60) == 0, proc.log()
    return proc.log()


def test_finding_10_sigterm_leaves_no_unretrieved_exception(fresh_swarm, llama_dir):
    peer = fresh_swarm.start_peer(llama_dir, block_indices="0:8")
    log = stop_cleanly(peer)
    assert "Stopped" in log
    assert UNRETRIEVED not in log, log
    dht_log = stop_cleanly(fresh_swarm.processes[0])
    assert UNRETRIEVED not in dht_log, dht_log


def test_finding_13_second_dht_with_the_same_identity_refuses(tmp_path, spawned):
    identity = tmp_path / "dht.id"
    first = spawn(spawned, tmp_path, "dht1", "dht", "--identity_path", str(identity))
    assert outcome(first, READY_DHT) is None, first.log()
    second = spawn(spawned, tmp_path, "dht2", "dht", "--identity_path", str(identity))
    assert outcome(second, READY_DHT) not in (None, 0), second.log()
    log = second.log()
    assert f"identity file {identity} is already used by another running swarm node" in log, log
    assert "--identity_path NEW_FILE" in log
    assert "Traceback" not in log
    assert first.popen.poll() is None  # the first one is undisturbed


def test_finding_13_second_peer_with_the_same_identity_refuses(dht_swarm, llama_dir, tmp_path):
    swarm, identity = dht_swarm, tmp_path / "peer.id"
    first = swarm.start_peer(llama_dir, block_indices="0:8", extra=["--identity_path", str(identity)])
    second = swarm.start_peer(llama_dir, block_indices="0:8", extra=["--identity_path", str(identity)],
                                    wait=False)
    assert outcome(second, READY_PEER) not in (None, 0), second.log()
    assert f"identity file {identity} is already used by another running swarm node" in second.log()
    # the first keeps its peer id and its lock; once it stopped, the identity may start again
    stop_cleanly(first)
    again = swarm.start_peer(llama_dir, block_indices="0:8", extra=["--identity_path", str(identity)])
    assert again.peer_id == first.peer_id


def test_finding_13_a_copy_of_an_online_identity_refuses(dht_swarm, llama_dir, tmp_path):
    """Another machine with a copy of the file: the swarm already has a node with this peer id."""
    swarm, identity, copy = dht_swarm, tmp_path / "peer.id", tmp_path / "elsewhere" / "peer.id"
    first = swarm.start_peer(llama_dir, block_indices="0:8", extra=["--identity_path", str(identity)])
    copy.parent.mkdir()
    shutil.copy2(identity, copy)
    second = swarm.start_peer(llama_dir, block_indices="0:8", extra=["--identity_path", str(copy)],
                                    wait=False)
    assert outcome(second, READY_PEER) not in (None, 0), second.log()
    log = second.log()
    assert f"peer id {first.peer_id} of identity file {copy} is already online in the swarm" in log, log
    assert "--identity_path NEW_FILE" in log


def test_finding_14_dht_on_a_taken_port_refuses(tmp_path, spawned):
    maddr = f"/ip4/127.0.0.1/tcp/{free_port()}"
    first = spawn(spawned, tmp_path, "dht1", "dht", "--host_maddrs", maddr)
    assert outcome(first, READY_DHT) is None, first.log()
    second = spawn(spawned, tmp_path, "dht2", "dht", "--host_maddrs", maddr)
    assert outcome(second, READY_DHT) not in (None, 0), second.log()
    log = second.log()
    assert f"--host_maddrs {maddr}: TCP port" in log and "already in use" in log, log
    assert "choose another port, or stop what holds it" in log
    assert "--initial_peers" not in log


def test_finding_14_peer_on_a_taken_port_refuses(dht_swarm, llama_dir):
    taken = dht_swarm.initial_peers[0].split("/p2p/")[0]  # the bootstrap peer's own address
    peer = dht_swarm.start_peer(llama_dir, block_indices="0:8", extra=["--host_maddrs", taken], wait=False)
    assert outcome(peer, READY_PEER) not in (None, 0), peer.log()
    log = peer.log()
    assert f"--host_maddrs {taken}: TCP port" in log and "choose another port" in log, log


def daemon_of(proc: SwarmProcess) -> int:
    """The pid of the p2p daemon a ``swarm`` process started (its child)."""
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    daemons = [int(pid) for pid in children if b"p2pd" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(daemons) == 1, children
    return daemons[0]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the daemon through /proc")
def test_finding_10_dht_stops_when_ctrl_c_stopped_its_daemon_first(tmp_path, spawned):
    """Ctrl-C in a terminal reaches the p2p daemon too; the node must still stop, not wait for it forever."""
    dht = spawn(spawned, tmp_path, "dht", "dht")
    assert outcome(dht, READY_DHT) is None, dht.log()
    os.kill(daemon_of(dht), signal.SIGKILL)
    log = stop_cleanly(dht)
    assert UNRETRIEVED not in log, log


def test_finding_14_a_bootstrap_node_restarts_on_its_own_port(tmp_path, llama_dir):
    """The check refuses a port in use, not one our last run left connections of (TIME_WAIT) on."""
    maddr = f"/ip4/127.0.0.1/tcp/{free_port()}"
    with LocalSwarm(tmp_path, update_period=1.0) as swarm:
        first = swarm._spawn(["dht", "--host_maddrs", maddr], "dht1")
        swarm.initial_peers = first.wait_for(READY_DHT, 120).group(1).split()
        swarm.start_peer(llama_dir, block_indices="0:8")  # connected to the bootstrap node's port
        stop_cleanly(first)
        again = swarm._spawn(["dht", "--host_maddrs", maddr], "dht2")
        assert outcome(again, READY_DHT) is None, again.log()
