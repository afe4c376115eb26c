"""The ``swarm`` command. Maps flags onto the config dataclasses and calls the runtime, nothing more."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from peers.cli.api import add_api_command
from peers.cli.chat import add_chat_command
from peers.cli.export import add_export_command
from peers.cli.graph_peer import add_graph_flags, run_graph_peer
from peers.cli.membership import add_membership_commands
from peers.cli.new_model import add_model_command
from peers.cli.options import (
    MODEL_HELP,
    block_indices,
    device_flags,
    lan_swarm,
    model_name_flag,
    probe_mib,
    route_flags,
    swarm_config,
    swarm_flags,
)
from peers.cli.output import TEXT, LineBreakingHandler
from peers.cli.parsing import SwarmParser
from peers.cli.train import add_train_command
from peers.core.config import DEFAULT_CACHE_DIR, StageServerConfig
from peers.core.devices import resolve_device
from peers.core.trainers import FLAG_HELP, parse_trainers
from peers.model.hub import resolve_model

logger = logging.getLogger("peers.cli")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    try:
        return args.func(args) or 0
    except (ValueError, RuntimeError) as e:
        TEXT.end_line()  # never on the generated text's line
        logger.error("%s", e)
        logger.debug("Details:", exc_info=True)
        return 2
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    common = SwarmParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", help="debug logs")
    parser = SwarmParser(prog="swarm", description="Serve and run LLMs on a peer-to-peer swarm.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add = sub.add_parser

    def sub_add_parser(name: str, **kwargs) -> argparse.ArgumentParser:
        kwargs.setdefault("description", kwargs.get("help"))
        return add(name, parents=[common], **kwargs)

    sub.add_parser = sub_add_parser  # every subcommand takes -v

    dht = sub.add_parser("dht", help="run a bootstrap peer and print the --initial_peers line to share")
    swarm_flags(dht, joining=False, role="dht")
    dht.set_defaults(func=_cmd_dht)

    peer = sub.add_parser("peer", help="host some blocks of a model and serve them to the swarm")
    peer.add_argument("model_dir", metavar="MODEL", nargs="?", default=None, help=MODEL_HELP)
    swarm_flags(peer, joining=True, role="peer")
    blocks = peer.add_mutually_exclusive_group()
    blocks.add_argument("--block_indices", type=block_indices,
                        help="serve blocks START:END, e.g. 0:4 (required: this, --num_blocks or --backup)")
    blocks.add_argument("--num_blocks", type=int,
                        help="serve N blocks, where the swarm is weakest (required: this, --block_indices or --backup)")
    blocks.add_argument("--backup", action="store_true",
                        help="start as a backup: measure, join, probe links and announce BACKUP with no blocks loaded, "
                             "ready to take a place (`swarm move`, or the swarm's plan)")
    peer.add_argument("--max_blocks", type=int, default=None,
                      help="blocks this peer can hold, announced for plans (default: what free memory holds)")
    peer.add_argument("--no_follow", dest="follow_plans", action="store_false",
                      help="never move this peer when the swarm's plan changes (operator opt-out)")
    peer.add_argument("--organise", action="store_true",
                      help="take part in the swarm-wide plan: in a private swarm, follow (and, when elected, make) the "
                           "broker's plan; in a public one, plan for itself and move only itself (runs' plans are "
                           "followed anyway, per --trainers)")
    peer.add_argument("--control_socket", type=Path, default=None,
                      help="a local unix socket (mode 0600) taking `move START:END` and `backup` lines (`swarm move`) "
                           "(default: none)")
    device_flags(peer)
    peer.add_argument("--num_threads", type=int, default=None,
                      help="CPU threads for torch (default: torch's); use 1 when several peers share a CPU")
    peer.add_argument("--public_name", default="", help="a name shown in `swarm status`")
    peer.add_argument("--metrics_port", type=int, default=0,
                      help="serve Prometheus metrics at http://METRICS_HOST:PORT/metrics (default 0: off)")
    peer.add_argument("--metrics_host", default="127.0.0.1",
                      help="address of the metrics port (default: this machine only; 0.0.0.0 for a remote scraper)")
    model_name_flag(peer)
    peer.add_argument("--max_batch_size", type=int, default=8, help="rows per request")
    peer.add_argument("--max_batch_tokens", type=int, default=2048,
                      help="tokens per batched forward: requests that arrive together are combined up to this")
    peer.add_argument("--max_request_bytes", type=int, default=64 << 20, help="larger requests are refused")
    peer.add_argument("--probe_max_mib", type=probe_mib, default=16, metavar="MIB",
                      help="the largest transfer of this peer's link probes, in MiB (default 16; probes grow from "
                           "1 MiB only while a transfer is quick, so fast links read right): lower it on a metered "
                           "line; 1 keeps every probe at 1 MiB")
    peer.add_argument("--request_timeout", type=float, default=60.0, help="deadline of one RPC, seconds")
    peer.add_argument("--update_period", type=float, default=15.0, help="seconds between announcements")
    peer.add_argument("--throughput", type=float, default=None,
                      help="tokens/s per block (default: measure once and cache in --cache_dir)")
    peer.add_argument("--retime_every", type=float, default=300.0, metavar="SECONDS",
                      help="time one block again every SECONDS while the peer is idle and announce the fastest "
                           "timing seen (a timing taken on a busy machine is not kept forever); default 300, 0: never")
    peer.add_argument("--cache_dir", type=Path, default=DEFAULT_CACHE_DIR, help="throughput cache folder")
    peer.add_argument("--cache_tokens", type=int, default=16384,
                      help="inference KV cache budget in tokens (batch rows x max_length, all sessions)")
    peer.add_argument("--session_timeout", type=float, default=60.0,
                      help="seconds an idle or disconnected inference session keeps its cache")
    peer.add_argument("--client_cache_share", type=float, default=0.5,
                      help="fraction of --cache_tokens one client may always hold; beyond it, only while no "
                           "other client waits for cache space")
    peer.add_argument("--cache_wait", type=float, default=2.0,
                      help="seconds a session open that does not fit waits for space before it is refused")
    peer.add_argument("--allow_plaintext", action="store_true",
                      help="also serve inference streams that skip encryption (for benchmarks and debugging)")
    peer.add_argument("--trainers", default=None, metavar="PEER_ID[,PEER_ID...]|members|anyone",
                      help=FLAG_HELP + " (default: nobody)")
    peer.add_argument("--adapters", default="anyone", metavar="anyone|members|none|PEER_ID[,PEER_ID...]",
                      help="who may train LoRA adapters of their own on these blocks (the blocks stay frozen and "
                           "other clients' results unchanged; base training needs --trainers); default: anyone")
    peer.add_argument("--no_train", action="store_true",
                      help="no-op, kept for old scripts: a peer trains only with --trainers")
    peer.add_argument("--checkpoint_dir", type=Path, default=None,
                      help="training: save our blocks' weights + AdamW state here, and resume from them (default: "
                           "not saved)")
    add_graph_flags(peer)  # swarm peer --graph ARCH: a stage of an operator graph (issue 18)
    peer.set_defaults(func=_cmd_peer)

    move = sub.add_parser("move", help="move a running peer on this machine to other blocks, or make it a backup "
                                       "(through its --control_socket)")
    move.add_argument("span", help="START:END to serve those blocks, `backup` to stop serving, `status` to ask")
    move.add_argument("--control_socket", type=Path, required=True, help="the peer's --control_socket (required)")
    move.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the move")
    move.set_defaults(func=_cmd_move)

    status = sub.add_parser("status", help="who is online, which blocks they serve, what is missing")
    status.add_argument("model", help="model folder, Hugging Face hub id (org/name, from the local cache) or the "
                                      "model's name in the swarm")
    swarm_flags(status, joining=True, new_swarm=False)
    model_name_flag(status)
    status.set_defaults(func=_cmd_status)

    monitor = sub.add_parser("monitor", help="a live web map of the swarm (coverage, peers, plans) and its JSON")
    monitor.add_argument("models", nargs="+", metavar="MODEL",
                         help="models to show: folders, hub ids (from the local cache) or names in the swarm")
    swarm_flags(monitor, joining=True, new_swarm=False)
    monitor.add_argument("--host", default="127.0.0.1",
                         help="address the web page listens on (default: this machine only; 0.0.0.0 shows it to "
                              "others, who then see what these credentials read)")
    monitor.add_argument("--port", type=int, default=8000, help="web port (0: any free port, printed)")
    monitor.add_argument("--refresh", type=float, default=5.0, help="seconds between readings of the swarm")
    monitor.set_defaults(func=_cmd_monitor)

    gen = sub.add_parser("generate", help="generate text through the swarm (token ids never leave this machine)")
    gen.add_argument("model_dir", metavar="MODEL", help=MODEL_HELP + "; the embeddings, head and tokenizer.json run "
                                                                      "here")
    swarm_flags(gen, joining=True, new_swarm=False)
    gen.add_argument("--prompt", required=True, help="text to continue (required)")
    gen.add_argument("--max_new_tokens", type=int, default=32, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=None,
                     help="sample with this temperature; 0 is greedy (default: greedy)")
    gen.add_argument("--top_k", type=int, default=None, help="sample among the k most likely tokens (default: all)")
    gen.add_argument("--top_p", type=float, default=None,
                     help="sample from the smallest set reaching this mass (default: 1, all)")
    gen.add_argument("--seed", type=int, default=None, help="makes sampling reproducible (default: random)")
    route_flags(gen)
    model_name_flag(gen)
    device_flags(gen)
    gen.add_argument("--checkpoint", type=Path, default=None, metavar="RUN_CHECKPOINT",
                     help="a `swarm train` run's trainer checkpoint (CHECKPOINT_DIR/RUN_ID or its trainer/ folder): "
                          "run its trained embedding and head here, with the blocks the run's peers serve now "
                          "(default: the model folder's)")
    gen.add_argument("--adapter", default="", metavar="RUN_ID|FOLDER",
                     help="generate with LoRA adapters: the run id of your adapter run (as its trainer: "
                          "--identity_path), or an exported adapter folder (peft format); the peers apply them to "
                          "this session only (default: none)")
    gen.set_defaults(func=_cmd_generate)

    add_api_command(sub)
    add_chat_command(sub)
    add_membership_commands(sub)
    add_model_command(sub)
    add_train_command(sub)

    add_export_command(sub)

    demo = sub.add_parser("demo", help="a whole swarm on this machine: bootstrap, 3 peers, a client")
    demo.add_argument("--workdir", type=Path, default=DEFAULT_CACHE_DIR / "demo", help="models and logs")
    demo.set_defaults(func=_cmd_demo)
    return parser


def _cmd_dht(args: argparse.Namespace) -> int:
    from peers.core.access import load_admission, load_identity
    from swarm.discovery import lan_presence, start_node, visible_maddrs
    from swarm.revocations import keep_revocations, serve_until

    swarm = swarm_config(args)
    identity = load_identity(swarm)
    admission = load_admission(swarm, identity)

    async def run(stop: asyncio.Event) -> None:
        node = await start_node(
            host_maddrs=swarm.host_maddrs, announce_maddrs=swarm.announce_maddrs, identity=identity,
            identity_path=swarm.identity_path, record_validator=admission.record_validator(), nat=swarm.nat(),
        )
        revocations = asyncio.ensure_future(keep_revocations(node, admission, period=15.0))
        lan = None
        try:
            maddrs = await visible_maddrs(node)
            print(f"To connect other peers to this one, use --initial_peers {' '.join(maddrs)}", flush=True)
            print(f"This is a {admission.describe()}", flush=True)
            if swarm.lan:  # peers and clients with no --initial_peers on this LAN find it
                lan = await lan_presence(node, swarm.host_maddrs)
            await serve_until(stop, revocations)  # or raise: our own certificate was revoked or expired
        finally:
            if lan is not None:
                await lan.close()
            revocations.cancel()
            await asyncio.wait([revocations])
            await node.shutdown()

    _run_until_signal(run)
    return 0


def _cmd_peer(args: argparse.Namespace) -> int:
    from peers.server.stage_server import StageServer

    if args.graph is not None:
        return run_graph_peer(args, swarm_config(args), _run_until_signal)
    if args.model_dir is None or (args.block_indices is None and args.num_blocks is None and not args.backup):
        raise ValueError("swarm peer needs MODEL and one of --block_indices, --num_blocks or --backup (or --graph "
                         "ARCH with --graph_nodes/--graph_stage for an operator graph)")
    if args.no_train and args.trainers:
        raise ValueError("--no_train and --trainers contradict each other: drop --no_train (training is off "
                         "unless --trainers is given)")
    config = StageServerConfig(
        model_dir=resolve_model(args.model_dir), swarm=swarm_config(args), model_name=args.model_name,
        block_indices=args.block_indices, num_blocks=args.num_blocks, device=resolve_device(args.device),
        torch_dtype=args.torch_dtype, public_name=args.public_name, max_batch_size=args.max_batch_size,
        max_batch_tokens=args.max_batch_tokens, max_request_bytes=args.max_request_bytes,
        probe_max_bytes=int(args.probe_max_mib * (1 << 20)), request_timeout=args.request_timeout,
        update_period=args.update_period, throughput=args.throughput, retime_every=args.retime_every,
        cache_dir=args.cache_dir, cache_tokens=args.cache_tokens, session_timeout=args.session_timeout,
        client_cache_share=args.client_cache_share, cache_wait=args.cache_wait,
        require_encryption=not args.allow_plaintext, trainers=parse_trainers(args.trainers),
        checkpoint_dir=args.checkpoint_dir, adapters=args.adapters, backup=args.backup, max_blocks=args.max_blocks,
        follow_plans=args.follow_plans, control_socket=args.control_socket, organise=args.organise,
        metrics_port=args.metrics_port, metrics_host=args.metrics_host,
    )
    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    server = StageServer(config)
    _run_until_signal(server.run)
    return 0


def _cmd_move(args: argparse.Namespace) -> int:
    from peers.server.control import send_command

    span = args.span.strip()
    line = span if span in ("backup", "status") else f"move {span}"
    try:
        answer = send_command(args.control_socket, line, timeout=args.timeout)
    except OSError as e:
        raise ValueError(f"could not reach the peer's control socket {args.control_socket}: {e} (is the peer running "
                         f"with --control_socket {args.control_socket}?)") from None
    print(answer, flush=True)
    return 0 if answer.startswith("ok") else 1


def _cmd_status(args: argparse.Namespace) -> int:
    from peers.cli.status import model_name_and_blocks, print_status, start_reader
    from swarm.discovery import fetch_swarm

    swarm = lan_swarm(swarm_config(args))
    if not swarm.initial_peers:
        raise ValueError("pass --initial_peers: the line `swarm dht` printed")
    name, total = model_name_and_blocks(args.model, args.model_name)

    async def snapshot():
        node = await start_reader(swarm)
        try:
            return await fetch_swarm(node, name, swarm.dht_timeout)
        finally:
            await node.shutdown()

    records, plans = asyncio.run(snapshot())
    total = total or max((r.end for r in records), default=0)
    print_status(name, records, total, plans=plans)
    return 0


def _cmd_monitor(args: argparse.Namespace) -> int:
    from peers.cli.status import model_name_and_blocks, start_reader
    from peers.monitor.app import Monitor, serve_monitor

    swarm = lan_swarm(swarm_config(args))
    if not swarm.initial_peers:
        raise ValueError("pass --initial_peers: the line `swarm dht` printed")
    if args.refresh <= 0:
        raise ValueError(f"--refresh must be positive, got {args.refresh}")
    models = [model_name_and_blocks(model) for model in args.models]

    async def run(stop: asyncio.Event) -> None:
        node = await start_reader(swarm)
        try:
            monitor = Monitor(node, models, refresh=args.refresh, private=swarm.credentials_path is not None,
                              dht_timeout=swarm.dht_timeout)
            await serve_monitor(monitor, args.host, args.port, stop)
        finally:
            await node.shutdown()

    _run_until_signal(run)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from peers.client.generation import SamplingConfig
    from peers.client.swarm_client import SwarmClient
    from peers.client.textgen import stream_text
    from peers.core.config import ClientConfig

    swarm = lan_swarm(swarm_config(args))
    if not swarm.initial_peers:
        raise ValueError("pass --initial_peers: the line `swarm dht` printed")
    sample = any(x is not None for x in (args.temperature, args.top_k, args.top_p))
    sampling = SamplingConfig(do_sample=sample, temperature=1.0 if args.temperature is None else args.temperature,
                              top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    config = ClientConfig(swarm=swarm, request_timeout=args.request_timeout, local_blocks=args.local_blocks,
                          topology=args.topology, compression=args.compression, model_name=args.model_name,
                          device=args.device, torch_dtype=args.torch_dtype, checkpoint=args.checkpoint,
                          adapter=args.adapter)
    with SwarmClient(resolve_model(args.model_dir), config=config) as client:
        try:
            for piece in stream_text(client, args.prompt, args.max_new_tokens, sampling=sampling):
                TEXT.write(piece)
        finally:
            TEXT.write("\n")  # end the text's line, also before an error's message
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from peers.cli.demo import run_demo

    return run_demo(args.workdir)


def _run_until_signal(run) -> None:
    """Run ``run(stop_event)`` on an event loop (uvloop if present) until SIGINT or SIGTERM."""

    async def wrapper() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await run(stop)

    try:
        import uvloop

        uvloop.run(wrapper())
    except ImportError:
        asyncio.run(wrapper())


def _setup_logging(verbose: bool) -> None:
    """Logs go to stderr (rich on a terminal), never to stdout, where generated text goes (``peers.cli.output``)."""
    level = logging.DEBUG if verbose else logging.INFO
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.logging import RichHandler

        inner: logging.Handler = RichHandler(console=Console(stderr=True), show_path=False,
                                             log_time_format="%H:%M:%S")
        inner.setFormatter(logging.Formatter("%(message)s"))
    else:
        inner = logging.StreamHandler(sys.stderr)
        inner.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    handler = LineBreakingHandler(inner, sys.stderr)
    for name in ("peers", "swarm", "privacy"):
        lg = logging.getLogger(name)
        lg.handlers[:] = [handler]
        lg.setLevel(level)
        lg.propagate = False
    logging.getLogger("hivemind").setLevel(logging.WARNING)


if __name__ == "__main__":
    sys.exit(main())
