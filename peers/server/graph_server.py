"""``GraphServer``: a peer serving one stage of an operator graph (``swarm peer --graph ARCH``).

It traces the architecture itself (``peers.model.graph``; never a graph received), keeps the nodes of its stage
(``--graph_nodes A:B``, or stage ``i/n`` of the planner's cut or an equal split), announces a ``PeerRecord`` under
``ARCH-HASH12`` (``swarm_model_name``) with ``start:end`` its node range, and serves graph forwards, backwards and
applies (``peers.server.graph_calls``) on the same encrypted, admitted stream as a stage of blocks.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

import peers
from peers.core.access import load_admission, load_identity
from peers.core.config import SwarmConfig
from peers.core.trainers import TrainerPolicy
from peers.model.graph.hashing import graph_hash
from peers.model.graph.stage import GraphStage
from peers.model.graph.swarm_graph import GraphSpec, stage_nodes, swarm_model_name
from peers.server.graph_calls import GraphCalls, GraphStreamHandler
from peers.server.graph_runs import GraphServing
from peers.server.handler import StageHandler
from peers.server.kv_sessions import SessionRegistry
from peers.wire.links import PeerLinks
from peers.wire.messages import StageInfo
from swarm.announcer import Announcer
from swarm.discovery import start_node, visible_maddrs
from swarm.records import PeerRecord, PeerState
from swarm.revocations import check_membership, serve_until

logger = logging.getLogger(__name__)


@dataclass
class GraphServerConfig:
    """One graph peer: the graph, its stage, the swarm and its limits."""

    spec: GraphSpec
    swarm: SwarmConfig
    nodes: tuple[int, int] | None = None  # --graph_nodes A:B
    stage: tuple[int, int] | None = None  # --graph_stage i/n
    split: str = "plan"  # how --graph_stage cuts: the planner's cut or an equal split by node count
    links: tuple[float, ...] | None = None  # --graph_links: bytes/s into each stage after the first (the planner's)
    trainers: tuple[str, ...] = ()
    request_timeout: float = 60.0
    update_period: float = 15.0
    max_request_bytes: int = 256 << 20
    require_encryption: bool = True
    public_name: str = ""
    checkpoint_dir: Path | None = None  # where runs are saved (every checkpoint_every steps, the trainer says)


def choose_nodes(config: GraphServerConfig, graph) -> tuple[int, int]:
    """The node range this peer serves (``ValueError`` saying what to pass)."""
    n = len(graph.order)
    if (config.nodes is None) == (config.stage is None):
        raise ValueError("a graph peer needs its stage: --graph_nodes A:B (a range of the graph's "
                         f"{n} nodes in topological order) or --graph_stage I/N")
    if config.nodes is not None:
        start, end = config.nodes
        if not 0 <= start < end <= n:
            raise ValueError(f"--graph_nodes {start}:{end} is not a non-empty range of {graph.arch}'s {n} nodes")
        return start, end
    index, count = config.stage  # type: ignore[misc]
    return stage_nodes(graph, index, count, config.split, config.spec.example_inputs(), config.links)


class GraphServer:
    """Traces, announces and serves one graph stage until stopped."""

    def __init__(self, config: GraphServerConfig) -> None:
        self.config = config
        self.trainers = TrainerPolicy(config.trainers, private=config.swarm.credentials_path is not None)
        graph = config.spec.trace()  # ValueError: unknown architecture, bad config or weights
        self.graph_hash = graph_hash(graph)
        self.model_name = swarm_model_name(graph, self.graph_hash)
        self.start, self.end = choose_nodes(config, graph)
        self.stage = GraphStage(graph, self.start, self.end)
        self.num_nodes = len(graph.order)
        self.ready = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        config, swarm = self.config, self.config.swarm
        identity = load_identity(swarm)
        admission = load_admission(swarm, identity)
        node = await start_node(initial_peers=swarm.initial_peers, host_maddrs=swarm.host_maddrs,
                                announce_maddrs=swarm.announce_maddrs, identity=identity,
                                identity_path=swarm.identity_path, record_validator=admission.record_validator(),
                                client_mode=swarm.client_mode, nat=swarm.nat(),
                                check_reachability=swarm.check_reachability)
        peer_id = str(node.peer_id)
        info = StageInfo(peer_id=peer_id, model=self.model_name, start=self.start, end=self.end, hidden_size=0,
                         dtype="float32", max_batch_size=0, max_seq_len=0,
                         max_request_bytes=config.max_request_bytes, throughput=0.0, version=peers.__version__)
        links = PeerLinks(node.p2p, admission, timeout=config.request_timeout)  # to the run's other replicas
        serving = GraphServing(self.stage, self.graph_hash, self.trainers, config.checkpoint_dir, peer_id=peer_id,
                               stream_for=links.get, average_timeout=config.request_timeout / 2)
        sessions = SessionRegistry(cache_tokens=1, timeout=60.0, max_length_limit=1)  # no inference sessions
        handler = StageHandler(None, info, sessions, request_timeout=config.request_timeout, identity=identity,
                               require_encryption=config.require_encryption, admission=admission)
        stream = GraphStreamHandler(None, info, sessions, request_timeout=config.request_timeout,
                                    check_hidden=_no_hidden, check_blocks=_no_blocks, identity=identity,
                                    require_encryption=config.require_encryption, admission=admission)
        stream.serve_graph(GraphCalls(serving, info, request_timeout=config.request_timeout,
                                      require_encryption=config.require_encryption))
        handler.inference = stream
        record = PeerRecord(peer_id=peer_id, model=self.model_name, start=self.start, end=self.end,
                            state=PeerState.JOINING, throughput=0.0, public_name=config.public_name,
                            version=peers.__version__, max_blocks=self.end - self.start)
        announcer = Announcer(node, record, period=config.update_period, check=lambda: check_membership(admission))
        added = False
        try:
            await announcer.start()
            await handler.add_p2p_handlers(node.p2p)
            added = True
            addresses = tuple(await visible_maddrs(node))
            announcer.update(state=PeerState.ONLINE, throughput=1.0, addresses=addresses)
            logger.info("Training of this stage allowed for %s", self.trainers.describe())
            logger.info("Serving graph nodes %d:%d of %s (%d nodes, hash %s) as peer %s; addresses: %s", self.start,
                        self.end, self.model_name, self.num_nodes, self.graph_hash[:16], peer_id, " ".join(addresses))
            self.ready.set()
            await serve_until(stop, asyncio.ensure_future(announcer.wait()))
        finally:
            await _quietly(announcer.stop(PeerState.OFFLINE))
            if added:
                await _quietly(handler.remove_p2p_handlers(node.p2p))
            links.close()
            await _quietly(node.shutdown())
            logger.info("Stopped")


def _no_hidden(*args, **kwargs) -> None:
    raise ValueError("this peer serves an operator graph, not blocks")


def _no_blocks(start: int, end: int) -> None:
    raise ValueError("this peer serves an operator graph, not blocks")


async def _quietly(coro) -> None:
    try:
        await asyncio.wait_for(coro, timeout=10)
    except Exception as e:
        logger.info("Shutdown step failed (%s); the p2p daemon may have stopped first", type(e).__name__)
