"""``peers.cli.launch`` places a process in a network namespace and has it listen on that host's address."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from peers.cli.launch import LocalSwarm, host_flags, netns_prefix

HOST = SimpleNamespace(netns="tbx-h2", address="10.101.0.3")


@pytest.mark.parametrize("host, extra, flags", [
    (None, (), []),
    (HOST, (), ["--host_maddrs", "/ip4/10.101.0.3/tcp/0"]),
    (HOST, ("--host_maddrs", "/ip4/10.101.0.3/tcp/31337"), []),  # the caller's own choice wins
])
def test_host_flags(host, extra, flags):
    assert host_flags(host, extra) == flags


@pytest.mark.parametrize("netns, prefix", [(None, []), ("tbx-h2", ["ip", "netns", "exec", "tbx-h2"])])
def test_netns_prefix(netns, prefix):
    assert netns_prefix(netns) == prefix


def test_start_peer_in_a_host_passes_its_address_and_namespace(tmp_path, monkeypatch):
    calls = []
    swarm = LocalSwarm(tmp_path)
    swarm.initial_peers = ["/ip4/10.101.0.1/tcp/4000/p2p/QmBootstrap"]
    monkeypatch.setattr(swarm, "_spawn", lambda args, name, host=None: calls.append((args, name, host)))
    swarm.start_peer(tmp_path / "model", block_indices="0:4", wait=False, name="p", host=HOST)
    swarm.start_peer(tmp_path / "model", block_indices="4:8", wait=False, name="q")
    (args, _, host), (plain, _, none) = calls
    assert host is HOST and none is None
    assert args[args.index("--host_maddrs") + 1] == "/ip4/10.101.0.3/tcp/0"
    assert "--host_maddrs" not in plain  # unchanged for callers on 127.0.0.1: the peer's loopback default


def test_probe_cap_flag(tmp_path, monkeypatch):
    """``--probe_max_mib``: 1 to 16 MiB (a probe starts at 1 MiB; peers refuse more than 16); ``LocalSwarm`` passes
    its ``probe_max_mib`` unless the caller gives its own."""
    import argparse

    from peers.cli.options import probe_mib

    assert probe_mib("4") == 4.0 and probe_mib("1") == 1.0
    for bad in ("0.5", "17", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            probe_mib(bad)
    calls = []
    swarm = LocalSwarm(tmp_path)
    swarm.initial_peers = ["/ip4/127.0.0.1/tcp/4000/p2p/QmBootstrap"]
    monkeypatch.setattr(swarm, "_spawn", lambda args, name, host=None: calls.append(args))
    swarm.probe_max_mib = 2
    swarm.start_peer(tmp_path / "model", block_indices="0:4", wait=False)
    swarm.start_peer(tmp_path / "model", block_indices="0:4", wait=False, extra=["--probe_max_mib", "8"])
    swarm.probe_max_mib = None
    swarm.start_peer(tmp_path / "model", block_indices="0:4", wait=False)
    first, own, none = calls
    assert first[first.index("--probe_max_mib") + 1] == "2"
    assert own.count("--probe_max_mib") == 1 and own[own.index("--probe_max_mib") + 1] == "8"
    assert "--probe_max_mib" not in none
