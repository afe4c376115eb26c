"""``swarm api``: an OpenAI-compatible HTTP server in front of the swarm (``peers/api``); also the flags and the
engine that ``swarm chat`` shares with it."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from pathlib import Path

from peers.cli.options import route_flags, swarm_config, swarm_flags

logger = logging.getLogger(__name__)
API_KEY_ENV = "SWARM_API_KEY"


def add_api_command(sub) -> None:
    api = sub.add_parser("api", help="an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions) on this "
                                     "machine, generating through the swarm",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    client_flags(api)
    api.add_argument("--host", default="127.0.0.1",
                     help="address to listen on; 0.0.0.0 exposes the API to other machines (then set --api_key)")
    api.add_argument("--port", type=int, default=8000, help="TCP port (0: any free one, printed)")
    api.add_argument("--api_key", default=None,
                     help=f"require `Authorization: Bearer KEY` on every request; or set ${API_KEY_ENV}, which keeps "
                          f"the key out of the process list (default: neither, no key)")
    api.add_argument("--max_tokens", type=int, default=256,
                     help="tokens generated when a request does not say (clipped to the context left)")
    api.add_argument("--metrics_port", type=int, default=None,
                     help="serve Prometheus metrics on this port (0: any free one, printed) at /metrics (default: off)")
    api.add_argument("--metrics_host", default="127.0.0.1", help="address the metrics port listens on")
    api.set_defaults(func=_cmd_api)


def client_flags(parser: argparse.ArgumentParser) -> None:
    """The model folder and how to reach and use the swarm (as ``swarm generate``)."""
    parser.add_argument("model_dir", type=Path, help="the model folder (config.json, embeddings, head, tokenizer.json)")
    swarm_flags(parser, joining=True, new_swarm=False)
    route_flags(parser)


def open_engine(args: argparse.Namespace, default_max_tokens: int):
    """A ``SwarmClient`` (close it) and the ``Engine`` on it, from ``client_flags``."""
    from peers.api.engine import Engine
    from peers.client.swarm_client import SwarmClient
    from peers.core.config import ClientConfig

    swarm = swarm_config(args)
    if not swarm.initial_peers:
        raise ValueError("pass --initial_peers: the line `swarm dht` printed")
    config = ClientConfig(swarm=swarm, request_timeout=args.request_timeout, local_blocks=args.local_blocks,
                          topology=args.topology, compression=args.compression)
    client = SwarmClient(args.model_dir, config=config)
    try:
        return client, Engine(client, default_max_tokens=default_max_tokens)
    except BaseException:
        client.close()
        raise


def _cmd_api(args: argparse.Namespace) -> int:
    from peers.api.app import start

    for flag in ("port", "metrics_port"):
        value = getattr(args, flag)
        if value is not None and not 0 <= value < 65536:
            raise ValueError(f"--{flag} must be in 0..65535, got {value}")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    client, engine = open_engine(args, args.max_tokens)
    stop = threading.Event()
    try:
        runner, url = client.loop.run(start(engine, host=args.host, port=args.port, api_key=api_key))
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        print(f"OpenAI-compatible API for model {engine.model_id!r} on {url}", flush=True)
        if args.metrics_port is not None:
            from peers.api import metrics

            port = metrics.serve(args.metrics_port, args.metrics_host)
            print(f"Prometheus metrics on http://{args.metrics_host}:{port}/metrics", flush=True)
        if args.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
            logger.warning("Listening on %s without --api_key: anyone who reaches this port can use it", args.host)
        while not stop.wait(1.0):
            pass
        client.loop.run(runner.cleanup(), timeout=15)
    finally:
        client.close()
    return 0
