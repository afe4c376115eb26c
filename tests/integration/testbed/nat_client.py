"""The client of test_nat_swarm.py, run inside a testbed host: ``python nat_client.py SPEC.json``.

Generates greedily through the swarm, then reports the tokens, every peer's announced addresses and the
addresses of this client's own connections to each peer (a relayed one has ``/p2p-circuit``), as one line
``result {json}``.
"""

from __future__ import annotations

import json
import sys

import torch

from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig, SwarmConfig
from swarm.discovery import fetch_records


def main(spec: dict) -> dict:
    swarm = SwarmConfig(initial_peers=tuple(spec["initial_peers"]), host_maddrs=(f"/ip4/{spec['address']}/tcp/0",))
    with SwarmClient(spec["model_dir"], config=ClientConfig(swarm=swarm, request_timeout=30)) as client:
        client.wait_for_records(spec["peers"])
        tokens = client.generate(torch.tensor(spec["input_ids"]), spec["max_new_tokens"]).tolist()
        records = client._loop.run(fetch_records(client.node, client.model_name), timeout=30)
        conns = client._loop.run(client.node.p2p.list_peers(), timeout=10)
    connections: dict[str, list[str]] = {}
    for info in conns:
        connections.setdefault(info.peer_id.to_base58(), []).extend(str(a) for a in info.addrs)
    return {"tokens": tokens, "addresses": {r.peer_id: list(r.addresses) for r in records},
            "connections": connections}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        result = main(json.load(f))
    print("result " + json.dumps(result), flush=True)
