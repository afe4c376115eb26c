"""``swarm peer --graph ARCH``: the flags of a peer serving a stage of an operator graph, and the command."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from peers.core.trainers import parse_trainers


def add_graph_flags(peer: argparse.ArgumentParser) -> None:
    group = peer.add_argument_group("operator graphs (instead of MODEL and --block_indices)")
    group.add_argument("--graph", default=None, metavar="ARCH",
                       help="serve a stage of a registered architecture's operator graph (resnet18..152, gpt2, llama, "
                            "gpt2-blocks, llama-blocks), traced here (default: none, serve MODEL's blocks)")
    group.add_argument("--graph_config", type=key_values, default={}, metavar="JSON|K=V,...",
                       help="the architecture's config, e.g. num_classes=10 (default: its defaults)")
    group.add_argument("--graph_inputs", type=key_values, default={}, metavar="JSON|K=V,...",
                       help="the input shape the graph is traced for, e.g. batch=8,image_size=224")
    group.add_argument("--weights", type=Path, default=None, metavar="DIR",
                       help="weights folder (model.safetensors; a Hugging Face folder for gpt2/llama); default: a "
                            "random init from --graph_seed")
    group.add_argument("--graph_seed", type=int, default=0, help="seed of the random init (default 0)")
    group.add_argument("--graph_nodes", type=node_range, default=None, metavar="A:B",
                       help="serve nodes A:B of the graph's topological order (required with --graph: this or "
                            "--graph_stage)")
    group.add_argument("--graph_stage", type=stage_index, default=None, metavar="I/N",
                       help="serve stage I of N (0-based), cut by --graph_split (required with --graph: this or "
                            "--graph_nodes)")
    group.add_argument("--graph_split", choices=("plan", "equal"), default="plan",
                       help="how --graph_stage cuts: the planner's cut (counted FLOPs and bytes) or an equal split by "
                            "node count (default: plan)")
    group.add_argument("--graph_links", type=link_rates, default=None, metavar="MBIT,...",
                       help="for --graph_split plan: Mbit/s of the link into each stage after the first (N-1 "
                            "figures; in the star, the slower of the trainer's links to the two stages), so the "
                            "planner cuts where little crosses a slow link (default: 1000 each). Every peer of the "
                            "graph must be given the same, or their stages will not meet")


def key_values(text: str) -> dict[str, Any]:
    """A JSON object, or ``k=v,k=v`` with each value read as JSON when it parses (else a string)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError("expected a JSON object")
        return value
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, raw = part.partition("=")
        if not eq or not key:
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {part!r}")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


def link_rates(text: str) -> tuple[float, ...]:
    """``100,8`` (Mbit/s) -> bytes/s each."""
    try:
        rates = tuple(float(x) * 1e6 / 8 for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected Mbit/s figures separated by commas, got {text!r}") from None
    if not rates or min(rates) <= 0:
        raise argparse.ArgumentTypeError(f"link rates must be positive, got {text!r}")
    return rates


def node_range(text: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B (node positions), got {text!r}") from None
    return a, b


def stage_index(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/N (stage I of N, 0-based), got {text!r}") from None
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"stage {i}/{n}: need 0 <= I < N")
    return i, n


def run_graph_peer(args: argparse.Namespace, swarm, run_until_signal) -> int:
    """``swarm peer --graph ARCH ...``."""
    from peers.model.graph.swarm_graph import GraphSpec
    from peers.server.graph_server import GraphServer, GraphServerConfig

    if args.model_dir is not None or args.block_indices is not None or args.num_blocks is not None or args.backup:
        raise ValueError("--graph serves a stage of an operator graph: drop MODEL and --block_indices/--num_blocks/"
                         "--backup, and give --graph_nodes A:B or --graph_stage I/N")
    unsupported = [flag for flag, given in (("--control_socket", args.control_socket), ("--organise", args.organise),
                                            ("--metrics_port", args.metrics_port)) if given]
    if unsupported:
        raise ValueError(f"{', '.join(unsupported)} not supported with --graph yet: drop them")
    spec = GraphSpec(args.graph, dict(args.graph_config), dict(args.graph_inputs), args.weights, args.graph_seed)
    config = GraphServerConfig(spec=spec, swarm=swarm, nodes=args.graph_nodes, stage=args.graph_stage,
                               split=args.graph_split, links=args.graph_links, trainers=parse_trainers(args.trainers),
                               request_timeout=args.request_timeout, update_period=args.update_period,
                               max_request_bytes=args.max_request_bytes, require_encryption=not args.allow_plaintext,
                               public_name=args.public_name, checkpoint_dir=args.checkpoint_dir)
    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    run_until_signal(GraphServer(config).run)
    return 0
