"""The client ``swarm export`` fetches a run's blocks or adapters with: the run's swarm, identity and model name."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from peers.cli.options import swarm_config
from peers.training import TrainConfig

if TYPE_CHECKING:
    from peers.client.swarm_client import SwarmClient


def run_client(config: TrainConfig, args: argparse.Namespace, what: str) -> SwarmClient:
    """A client of the run's swarm (``--initial_peers``, identity, model name) to fetch ``what`` from its peers."""
    from peers.client.swarm_client import SwarmClient
    from peers.core.config import ClientConfig

    swarm = swarm_config(args)
    if not swarm.initial_peers:
        raise ValueError(f"pass --initial_peers (the line `swarm dht` printed) to fetch {what} from the run's "
                         "peers, or --blocks_from with the peers' --checkpoint_dir folders")
    client_config = ClientConfig(swarm=swarm, model_name=args.model_name or config.model_name,
                                 request_timeout=args.request_timeout)
    return SwarmClient(config.model_dir, config=client_config)
