"""Issue 11 part 4: a peer behind NAT serves blocks through a relay, and with relays off it is told what to do.

Hosts: h0 runs the bootstrap peer (``swarm dht``: it relays for others), h1 a public stage peer (blocks 0:4),
h2 the client; ``nat0`` sits behind a masquerading router (it can dial out, nobody can dial it) and serves
blocks 4:8. The NAT peer's reachability check fails (h0 cannot dial it back), so it restarts behind h0 as its
relay; the client's generation equals one process, over a relayed connection to the NAT peer. The same peer
with ``--no_relay`` exits, saying how to become reachable. Everything is removed afterwards.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from peers.cli.launch import LocalSwarm
from peers.model import LocalModel
from swarm.testbed import Testbed
from swarm.testbed.cleanup import leftovers, nothing_left
from swarm.testbed.netns import pids_in_netns

CLIENT = Path(__file__).with_name("nat_client.py")


def test_a_peer_behind_nat_serves_through_a_relay_and_without_relays_is_told_what_to_do(needs_nft, llama_dir,
                                                                                         tmp_path):
    input_ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(5))
    with Testbed(3, "lan", workdir=tmp_path / "tb") as tb:
        prefix, nat = tb.prefix, tb.add_nat_host()
        h0, h1, h2 = tb.hosts
        with LocalSwarm(tmp_path / "swarm", update_period=2.0) as swarm:
            swarm.start_dht(host=h0)
            # the three peers start together: a public one; the NAT peer with relays off, which asks h0 to dial it
            # back, cannot be dialled, and exits saying what to do; the same peer with relays on (the default)
            public = swarm.start_peer(llama_dir, block_indices="0:4", name="public", host=h1, wait=False)
            refused = swarm.start_peer(llama_dir, block_indices="4:8", name="nat-norelay", host=nat, wait=False,
                                       extra=["--no_relay"])
            relayed = swarm.start_peer(llama_dir, block_indices="4:8", name="nat", host=nat, wait=False)
            swarm.wait_ready(public)
            assert "Reachable directly" in public.log()

            assert refused.popen.wait(90) == 2, refused.log()[-3000:]
            message = refused.log()
            assert "this peer is not reachable" in message
            assert "could not dial you directly" in message
            assert "drop --no_relay" in message and "--announce_maddrs" in message and "forward a TCP port" in message
            assert f"the swarm sees this machine at {nat.public_address}" in message  # its router's address
            assert "Serving blocks" not in message

            # relays on: the same peer serves through its relay, h0
            swarm.wait_ready(relayed)
            assert "serving through relay(s)" in relayed.log(), relayed.log()[-3000:]
            relay_id = swarm.initial_peers[0].rsplit("/p2p/", 1)[1]

            spec = tmp_path / "client.json"
            spec.write_text(json.dumps({"model_dir": str(llama_dir), "initial_peers": swarm.initial_peers,
                                        "address": h2.address, "peers": 2, "input_ids": input_ids.tolist(),
                                        "max_new_tokens": 12}))
            client = tb.spawn(h2, [sys.executable, str(CLIENT), str(spec)], name="client")
            client.wait(120)
            log = client.log_path.read_text(errors="replace")
            lines = [line for line in log.splitlines() if line.startswith("result ")]
            assert client.returncode == 0 and lines, f"client failed (exit {client.returncode}):\n{log[-3000:]}"
            result = json.loads(lines[-1][len("result "):])
            pids = sorted({pid for ns in tb.state.namespaces for pid in pids_in_netns(ns)})
    assert nothing_left(leftovers(prefix, pids)), leftovers(prefix, pids)

    assert result["tokens"] == LocalModel.from_dir(llama_dir).generate_greedy(input_ids, 12).tolist()
    # the NAT peer announces only its relayed address, and the client reached it through the relay
    assert result["addresses"][relayed.peer_id] == [f"{swarm.initial_peers[0]}/p2p-circuit/p2p/{relayed.peer_id}"]
    to_nat = result["connections"][relayed.peer_id]
    assert to_nat and all(f"/p2p/{relay_id}/p2p-circuit" in a for a in to_nat), to_nat
    assert all("p2p-circuit" not in a for a in result["connections"][public.peer_id])  # the public peer: directly
