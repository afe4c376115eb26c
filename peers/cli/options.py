"""Options that several ``swarm`` commands share, and how they map onto the config dataclasses."""

from __future__ import annotations

import argparse
from pathlib import Path

from peers.core.config import LOCAL_HOST_MADDRS, SwarmConfig, parse_block_indices
from peers.core.ids import DTYPES


def block_indices(text: str) -> tuple[int, int]:
    """``--block_indices START:END`` for argparse: its own message on a bad value (argparse would hide a
    ``ValueError``'s behind "invalid parse_block_indices value")."""
    try:
        return parse_block_indices(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


MODEL_HELP = ("model folder (Hugging Face layout: config.json, *.safetensors, tokenizer.json) or hub id org/name, "
              "found in the local Hugging Face cache (offline; `hf download org/name` fetches it)")


def probe_mib(text: str) -> float:
    """``--probe_max_mib``: 1 to 16 (MiB; a peer refuses larger probe transfers)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MiB between 1 and 16, got {text!r}") from None
    if not 1 <= value <= 16:
        raise argparse.ArgumentTypeError(f"expected MiB between 1 and 16 (a probe starts at 1 MiB; peers refuse more "
                                         f"than 16), got {text}")
    return value


def model_name_flag(parser: argparse.ArgumentParser) -> None:
    """``--model_name``: the model's name in the swarm (its DHT key), for every command that names a model."""
    parser.add_argument("--model_name", default=None,
                        help="name of the model in the swarm (default: the folder's name; org--name for a hub id), "
                             "e.g. the name the peers were started with")


def device_flags(parser: argparse.ArgumentParser) -> None:
    """``--device`` and ``--torch_dtype``, ``auto`` by default as in Petals (``peers.core.devices``)."""
    parser.add_argument("--device", default="auto",
                        help="auto (cuda when a GPU is visible, else cpu), cpu, cuda, cuda:1, ...")
    parser.add_argument("--torch_dtype", default="auto", choices=[*DTYPES, "auto"],
                        help="auto: float32 on the CPU; on a GPU the checkpoint's dtype (half precision as bfloat16 "
                             "where the GPU supports it)")


# defaults of the NAT/relay flags per kind of command (see nat_flags)
ROLES = {
    "dht": dict(use_auto_relay=False, force_reachability="public", client_mode=False),
    "peer": dict(use_auto_relay=True, force_reachability=None, client_mode=False),
    "client": dict(use_auto_relay=False, force_reachability=None, client_mode=True),
}
NAT_HELP = {
    "dht": "a bootstrap peer must be reachable, and it relays for peers behind NAT: it forces its reachability "
           "public, which gives each relayed connection long limits",
    "peer": "a peer joining a swarm asks its initial peers to dial it back; behind NAT it serves through slots on "
            "relays (its initial peers), with --no_relay or --no_auto_relay it refuses to start, saying what to do",
    "client": "a client only dials out (a DHT client, --client_mode is always on), so it works behind NAT with "
              "no flags; relays let it reach peers that serve behind NAT",
}


def route_flags(parser: argparse.ArgumentParser) -> None:
    """How a client's requests travel through the swarm (``swarm generate``, ``api``, ``chat``)."""
    parser.add_argument("--request_timeout", type=float, default=30.0, help="seconds per step before re-routing")
    parser.add_argument("--local_blocks", type=int, default=0,
                        help="also run the first N blocks here, so peers never see the earliest activations")
    parser.add_argument("--topology", choices=("chain", "star"), default="chain",
                        help="chain: each peer hands its output straight to the next one; star: every hidden state "
                             "goes through this machine")
    parser.add_argument("--compression", default="none",
                        help="how hidden states travel: none (bit-exact), fp16, bf16, int8 or topk:F[/fp16|bf16|int8];"
                             " lossy codecs save bandwidth and may change tokens (benchmarks/lossy_inference.py)")


def swarm_flags(parser: argparse.ArgumentParser, *, joining: bool, new_swarm: bool = True,
                role: str = "client") -> None:
    """How a command reaches the swarm: bootstrap peers, addresses, identity, private-swarm credentials, NAT."""
    if joining:
        parser.add_argument("--initial_peers", nargs="+", default=[], help="multiaddrs printed by `swarm dht`")
    if joining and new_swarm:
        parser.add_argument("--new_swarm", action="store_true", help="start a new swarm (no --initial_peers)")
    parser.add_argument(
        "--host_maddrs", nargs="+", default=list(LOCAL_HOST_MADDRS),
        help="where to listen (default: loopback only); e.g. /ip4/0.0.0.0/tcp/31337 to accept other machines",
    )
    parser.add_argument("--announce_maddrs", nargs="+", default=[], help="public addresses to announce")
    parser.add_argument("--identity_path", type=Path, default=None,
                        help="key file that fixes this peer id (default: a new peer id on every start)")
    parser.add_argument("--private", type=Path, default=None, metavar="CREDENTIALS",
                        help="join a private swarm with these member credentials (from `swarm invite`) (default: a "
                             "public swarm)")
    parser.add_argument("--revocations", type=Path, default=None,
                        help="a private swarm's revocation file from `swarm revoke` (members also spread it) "
                             "(default: none)")
    parser.add_argument("--no_mdns", dest="mdns", action="store_false",
                        help="with no --initial_peers, do not look for the swarm on the LAN nor advertise this node "
                             "there (mDNS; default: on in a public swarm with no --initial_peers; listen on the LAN "
                             "with --host_maddrs /ip4/0.0.0.0/tcp/0)")
    nat_flags(parser, role)


def lan_swarm(swarm: SwarmConfig) -> SwarmConfig:
    """``swarm`` with the initial peers found on the LAN if it has none (``SwarmConfig.lan``); a client's, so
    ``ValueError`` if none answers, saying what to do."""
    if not swarm.lan:
        return swarm
    import asyncio
    import dataclasses

    from swarm.lan import FIND_WAIT, find_swarm

    found = asyncio.run(find_swarm(swarm.host_maddrs))
    if not found:
        raise ValueError(f"no swarm answered on the LAN within {FIND_WAIT:g} s (mDNS on "
                         f"{' '.join(swarm.host_maddrs)}): pass --initial_peers (the line `swarm dht` printed), or "
                         f"start peers with --host_maddrs /ip4/0.0.0.0/tcp/0 on this LAN (and this command too)")
    return dataclasses.replace(swarm, initial_peers=tuple(found))


def nat_flags(parser: argparse.ArgumentParser, role: str) -> None:
    """``--use_relay/--no_relay``, ``--use_auto_relay/--no_auto_relay``, ``--force_reachability``, ``--relays``,
    ``--client_mode``, with the defaults of ``role`` ("dht", "peer" or "client")."""
    defaults = ROLES[role]
    group = parser.add_argument_group("NAT and relays", NAT_HELP[role])
    group.add_argument("--use_relay", dest="use_relay", action="store_true", default=True,
                       help="dial peers behind NAT through relays, and relay for others (default)")
    group.add_argument("--no_relay", dest="use_relay", action="store_false", help="no relays at all")
    group.add_argument("--use_auto_relay", dest="use_auto_relay", action="store_true",
                       default=defaults["use_auto_relay"],
                       help="behind NAT, serve through slots on relays" + (
                           " (default)" if defaults["use_auto_relay"] else
                           " (no effect here: a client serves nothing)" if role == "client" else ""))
    group.add_argument("--no_auto_relay", dest="use_auto_relay", action="store_false",
                       help="never serve through relays" + ("" if defaults["use_auto_relay"] else " (default)"))
    group.add_argument("--force_reachability", choices=["public", "private", "auto"],
                       default=defaults["force_reachability"] or "auto",
                       help="public: reachable directly (skip the check); private: behind NAT (go straight to the "
                            "relays); auto: check (default)" if role == "peer" else
                            f"public, private, or auto (AutoNAT decides); default "
                            f"{defaults['force_reachability'] or 'auto'}")
    group.add_argument("--relays", nargs="+", default=[], metavar="MADDR",
                       help="trusted relays to take slots on, full multiaddrs like --initial_peers "
                            "(default: the initial peers)")
    if role != "dht":  # a bootstrap peer is the DHT
        group.add_argument("--client_mode", action="store_true", default=defaults["client_mode"],
                           help="only dial out: a DHT client that stores nobody's records" + (
                               " (always on here)" if role == "client" else " (a peer behind relays is one by itself)"))


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
        use_relay=args.use_relay,
        use_auto_relay=args.use_auto_relay,
        force_reachability=None if args.force_reachability == "auto" else args.force_reachability,
        relays=tuple(args.relays),
        client_mode=getattr(args, "client_mode", False),
        mdns=args.mdns,
    )
