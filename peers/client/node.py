"""``ClientNode``: what an inference session and the token loop need from a client, as a ``Protocol``.

``SwarmClient`` is one; sessions and generation name this instead, so that none of them imports the client
(which imports them).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from peers.client.adapters import ClientAdapter
from peers.core.config import ClientConfig
from peers.model import ModelConfig
from peers.model.checkpoint import StageBlocks
from peers.wire.stream import PeerStream
from swarm.routing import Router


class ClientNode(Protocol):
    """A client's parts that run here (embedding, head, its first blocks) and its ways to reach the swarm."""

    config: ClientConfig
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    embedding: nn.Module
    head: nn.Module
    first_remote: int  # blocks [0, first_remote) run here
    local_blocks: StageBlocks | None
    router: Router
    adapter: ClientAdapter  # the LoRA adapters its requests run with (``ClientConfig.adapter``)

    async def peer_stream(self, peer_id: str) -> PeerStream:
        """This node's one stream to ``peer_id``."""
        ...
