"""Options that several ``swarm`` commands share, and how they map onto the config dataclasses."""

from __future__ import annotations

import argparse
from pathlib import Path

from peers.core.config import LOCAL_HOST_MADDRS, SwarmConfig, parse_block_indices


def block_indices(text: str) -> tuple[int, int]:
    """``--block_indices START:END`` for argparse: its own message on a bad value (argparse would hide a
    ``ValueError``'s behind "invalid parse_block_indices value")."""
    try:
        return parse_block_indices(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def swarm_flags(parser: argparse.ArgumentParser, *, joining: bool, new_swarm: bool = True) -> None:
    """How a command reaches the swarm: bootstrap peers, addresses, identity, private-swarm credentials."""
    if joining:
        parser.add_argument("--initial_peers", nargs="+", default=[], help="multiaddrs printed by `swarm dht`")
    if joining and new_swarm:
        parser.add_argument("--new_swarm", action="store_true", help="start a new swarm (no --initial_peers)")
    parser.add_argument(
        "--host_maddrs", nargs="+", default=list(LOCAL_HOST_MADDRS),
        help="where to listen (default: loopback only); e.g. /ip4/0.0.0.0/tcp/31337 to accept other machines",
    )
    parser.add_argument("--announce_maddrs", nargs="+", default=[], help="public addresses to announce")
    parser.add_argument("--identity_path", type=Path, default=None, help="key file that fixes this peer id")
    parser.add_argument("--private", type=Path, default=None, metavar="CREDENTIALS",
                        help="join a private swarm with these member credentials (from `swarm invite`)")
    parser.add_argument("--revocations", type=Path, default=None,
                        help="a private swarm's revocation file from `swarm revoke` (members also spread it)")


def swarm_config(args: argparse.Namespace) -> SwarmConfig:
    """The ``SwarmConfig`` of the flags ``swarm_flags`` added."""
    return SwarmConfig(
        initial_peers=tuple(getattr(args, "initial_peers", ())),
        host_maddrs=tuple(args.host_maddrs),
        announce_maddrs=tuple(args.announce_maddrs),
        identity_path=args.identity_path,
        credentials_path=args.private,
        revocation_path=args.revocations,
        new_swarm=getattr(args, "new_swarm", False),
    )
