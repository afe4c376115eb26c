"""A private swarm end to end on this machine: an owner, two member peers and a member client.

    python examples/private_swarm.py [--workdir DIR]

The same steps with the command line (each on its own machine in real life):

    swarm keygen   --owner_key owner.key                                   # owner, once
    swarm identity --identity_path alice.id                                # each member: prints its public key
    swarm invite   --owner_key owner.key --member_key HEX --name alice --out alice.member   # owner
    swarm dht  --identity_path dht.id --private dht.member                 # a member bootstrap peer
    swarm peer MODEL --num_blocks 4 --initial_peers ... --identity_path alice.id --private alice.member
    swarm generate MODEL --prompt "..." --initial_peers ... --identity_path me.id --private me.member
    swarm revoke   --owner_key owner.key --name alice --initial_peers ...  # owner: shut alice out
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from peers.cli.launch import READY_DHT, LocalSwarm, SwarmProcess
from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig, SwarmConfig
from peers.model import LocalModel, make_tiny_model
from privacy.identity import Identity
from privacy.membership import SwarmOwner


def invite(owner: SwarmOwner, folder: Path, name: str) -> tuple[Path, Path]:
    """What a member does (make an identity) and what the owner does (certify its public key)."""
    identity_path, credentials_path = folder / f"{name}.id", folder / f"{name}.member"
    member = Identity.load_or_create(identity_path)  # the member keeps this file; only its public key travels
    owner.invite(member.public_bytes, name, ttl=3600).save(credentials_path, overwrite=True)
    return identity_path, credentials_path


def member_flags(owner: SwarmOwner, folder: Path, name: str) -> list[str]:
    identity_path, credentials_path = invite(owner, folder, name)
    return ["--identity_path", str(identity_path), "--private", str(credentials_path)]


def main(workdir: Path) -> None:
    model_dir = make_tiny_model(workdir / "llama-tiny", family="llama", hidden_size=64, num_layers=4, num_heads=4,
                                num_kv_heads=2, intermediate_size=128, seed=0)
    owner = SwarmOwner.generate()  # `swarm keygen`: the owner key names the swarm and signs invites
    print(f"owner created private swarm {owner.swarm_id[:16]}...")

    processes: list[SwarmProcess] = []
    try:
        dht = SwarmProcess(["dht", *member_flags(owner, workdir, "bootstrap")], workdir / "dht.log", "dht")
        processes.append(dht)
        initial_peers = [m for m in dht.wait_for(READY_DHT, 60).group(1).split() if "127.0.0.1" in m]
        for name, blocks in (("alice", "0:2"), ("bob", "2:4")):
            peer = SwarmProcess(["peer", str(model_dir), "--block_indices", blocks, "--initial_peers", *initial_peers,
                                 "--update_period", "2", "--num_threads", "1", *member_flags(owner, workdir, name)],
                                workdir / f"{name}.log", name)
            processes.append(peer)
            start, end, peer_id = LocalSwarm.wait_ready(peer)
            print(f"member {name} serves blocks {start}:{end} as {peer_id[-8:]}")

        identity_path, credentials_path = invite(owner, workdir, "carol")
        swarm = SwarmConfig(initial_peers=tuple(initial_peers), identity_path=identity_path,
                            credentials_path=credentials_path)
        with SwarmClient(model_dir, config=ClientConfig(swarm=swarm)) as client:
            client.wait_for_records(2)
            prompt = torch.tensor([list(b"private swarm")])
            tokens = client.generate(prompt, 8)
            expected = LocalModel.from_dir(model_dir).generate_greedy(prompt, 8)
            print(f"member carol generated {tokens[0, prompt.shape[1]:].tolist()} over encrypted streams; "
                  f"{'equal to' if torch.equal(tokens, expected) else 'DIFFERENT from'} the local model's tokens")

        outsider = SwarmConfig(initial_peers=tuple(initial_peers))  # knows the address, has no invite
        with SwarmClient(model_dir, config=ClientConfig(swarm=outsider, request_timeout=10)) as client:
            print(f"an outsider reads {len(client.records())} records")
    finally:
        for process in reversed(processes):
            process.stop()
    print("stopped every process this example started")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=None, help="where keys, model and logs go (default: temp)")
    args = parser.parse_args()
    if args.workdir is None:
        with tempfile.TemporaryDirectory(prefix="fusionswarm-private-") as tmp:
            main(Path(tmp))
    else:
        args.workdir.mkdir(parents=True, exist_ok=True)
        main(args.workdir)
