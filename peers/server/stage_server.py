"""``StageServer``, the composition root of a peer: DHT node, blocks, handler, announcer."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import torch
from hivemind.dht.node import DHTNode

import peers
from peers.core.access import load_admission, load_identity
from peers.core.config import StageServerConfig
from peers.core.ids import DTYPES
from peers.model import ModelConfig, load_blocks
from peers.server.backend import StageBackend
from peers.server.handler import StageHandler
from peers.server.kv_sessions import SessionRegistry
from peers.server.prober import LinkProber
from peers.server.training_rpc import TrainingRPC
from peers.wire.links import PeerLinks
from peers.wire.messages import StageInfo
from swarm.announcer import Announcer
from swarm.block_selection import choose_blocks
from swarm.discovery import fetch_records, start_node, visible_maddrs
from swarm.keys import check_model_name
from swarm.links import LinkTable
from swarm.measure import Compute, cached_compute, time_per_call
from swarm.records import PeerRecord, PeerState
from swarm.revocations import check_membership, keep_revocations, serve_until

logger = logging.getLogger(__name__)

MEASURE_TOKENS = 128  # tokens per measured forward of one block


class StageServer:
    """Loads a contiguous range of blocks, measures them, announces itself and serves until stopped."""

    def __init__(self, config: StageServerConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model_dir)
        self.model_name = check_model_name(config.model_name or self.model_config.name)
        dtype_name = self.model_config.torch_dtype if config.torch_dtype == "auto" else config.torch_dtype
        self.dtype = DTYPES.get(dtype_name, torch.float32)
        self.device = torch.device(config.device)
        if config.block_indices is not None and config.block_indices[1] > self.model_config.num_layers:
            raise ValueError(
                f"--block_indices {config.block_indices[0]}:{config.block_indices[1]} is beyond the model's "
                f"{self.model_config.num_layers} blocks"
            )
        if config.num_blocks is not None and config.num_blocks > self.model_config.num_layers:
            raise ValueError(f"--num_blocks {config.num_blocks} exceeds the model's {self.model_config.num_layers}")
        self.node: DHTNode | None = None
        self.record: PeerRecord | None = None
        self.ready = asyncio.Event()
        self.link_table = LinkTable()  # our links to other peers: replica traffic (passive) and probes

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set, then leave cleanly (announce offline, stop the daemon)."""
        swarm = self.config.swarm
        self.identity = load_identity(swarm)  # our peer id; signs our handshakes
        self.admission = load_admission(swarm, self.identity)  # who may call us; signs and seals our records
        self.node = await start_node(
            initial_peers=swarm.initial_peers,
            host_maddrs=swarm.host_maddrs,
            announce_maddrs=swarm.announce_maddrs,
            identity=self.identity,
            identity_path=swarm.identity_path,  # locked while we run: a second peer with it is refused
            record_validator=self.admission.record_validator(),
            client_mode=swarm.client_mode, nat=swarm.nat(),
            check_reachability=swarm.check_reachability,  # others must dial us (directly or through a relay)
        )
        announcer = backend = handler = reaper = links = probing = None
        try:
            peer_id = str(self.node.peer_id)
            start, end = await self._choose_blocks()
            announcer = Announcer(self.node, self._make_record(peer_id, start, end), period=self.config.update_period,
                                  check=lambda: check_membership(self.admission),
                                  refresh=lambda r: dataclasses.replace(r, links=self.link_table.best_rows()))
            await announcer.start()  # JOINING: other joining peers see our blocks and choose others
            logger.info("Loading blocks %d:%d of %s", start, end, self.model_name)
            blocks = load_blocks(self.config.model_dir, start, end, device=self.device, dtype=self.dtype)
            compute = None if self.config.throughput else self._measure(blocks)
            throughput = self.config.throughput or 1.0 / compute.forward  # type: ignore[union-attr]
            sessions = SessionRegistry(cache_tokens=self.config.cache_tokens, timeout=self.config.session_timeout,
                                       max_length_limit=self.model_config.max_position_embeddings,
                                       client_share=self.config.client_cache_share, cache_wait=self.config.cache_wait)
            backend = StageBackend(
                blocks, start=start, device=self.device, dtype=self.dtype,
                max_batch_tokens=self.config.max_batch_tokens, active_sessions=sessions.attached_count,
            )
            await backend.launch()
            reaper = asyncio.gather(_reap_forever(sessions), keep_revocations(  # they raise if we are shut out
                self.node, self.admission, period=self.config.update_period), announcer.wait())
            info = self._make_info(peer_id, start, end, throughput)
            links = PeerLinks(self.node.p2p, self.admission, timeout=self.config.request_timeout,
                              observe=self.link_table.observe)
            training = await self._training(blocks, info, links)
            handler = StageHandler(backend, info, sessions, request_timeout=self.config.request_timeout,
                                   identity=self.identity, require_encryption=self.config.require_encryption,
                                   admission=self.admission, training=training, stream_for=links.get)
            await handler.add_p2p_handlers(self.node.p2p)
            addresses = tuple(await visible_maddrs(self.node))  # announced or relayed ones (swarm.discovery)
            announcer.update(state=PeerState.ONLINE, throughput=throughput, addresses=addresses,
                             forward_seconds=compute.forward if compute else 0.0,
                             backward_seconds=compute.backward if compute else 0.0)
            self.record = announcer.record
            probing = asyncio.create_task(self._prober(peer_id, links, announcer).run())
            logger.info(
                "Serving blocks %d:%d of %s as peer %s (%.0f tokens/s per block); addresses: %s",
                start, end, self.model_name, peer_id, throughput, " ".join(addresses),
            )
            self.ready.set()
            await serve_until(stop, reaper)  # or raise MembershipError: our certificate was revoked or expired
            logger.info("Shutting down: announcing offline")
        finally:
            if probing is not None:
                probing.cancel()
                await asyncio.gather(probing, return_exceptions=True)
            if announcer is not None:
                await _quietly(announcer.stop(PeerState.OFFLINE), "announce offline")
            if handler is not None:
                await _quietly(handler.remove_p2p_handlers(self.node.p2p), "remove handlers")
            if reaper is not None:
                await _stop_background(reaper)
            if backend is not None:
                await backend.shutdown()
            if handler is not None and handler.training is not None:
                handler.training.shutdown()  # finishes the running computation first
                handler.training.save_unsaved()
            if links is not None:
                links.close()
            await _quietly(self.node.shutdown(), "stop the DHT node")
            logger.info("Stopped")

    def _prober(self, peer_id: str, links: PeerLinks, announcer: Announcer) -> LinkProber:
        """Probes the other peers of our model that we know nothing of, and publishes our best links."""
        async def fetch() -> list[PeerRecord]:
            return await asyncio.wait_for(fetch_records(self.node, self.model_name), self.config.swarm.dht_timeout)

        def publish(rows, wake: bool) -> None:  # each announcement refreshes the rows; new probes: announce now
            announcer.update(links=rows, wake=wake)
            self.record = announcer.record

        return LinkProber(self.link_table, links.get, fetch, peer_id, publish)

    async def _training(self, blocks, info: StageInfo, links: PeerLinks) -> TrainingRPC | None:
        """The training side, if the operator allows trainers (``--trainers``): it trains the weights we serve."""
        policy = self.config.trainer_policy()
        if not policy.enabled:
            logger.info("Training is off: pass --trainers PEER_ID[,...] (or members, or anyone) to let trainers "
                        "train these blocks")
            return None
        if policy.anyone:
            logger.warning("--trainers anyone: %s may train these blocks, and every client then computes with what "
                           "it trained", policy.describe())
        else:
            logger.info("Training allowed for %s", policy.describe())
        training = TrainingRPC(blocks, info, trainers=policy, checkpoint_dir=self.config.checkpoint_dir,
                               stream_for=links.get, chain_timeout=self.config.request_timeout)
        training.resume_latest()  # our own checkpoint first: a replica's weights never replace newer ones
        await self._fetch_from_replica(training, info.start, info.end)
        return training

    async def _fetch_from_replica(self, training: TrainingRPC, start: int, end: int) -> None:
        """A late replica starts from the weights its span's replicas serve now (they may have trained); one with
        its own checkpoint keeps it (``TrainingRPC.start_from_replicas``)."""
        try:
            records = await asyncio.wait_for(fetch_records(self.node, self.model_name), self.config.swarm.dht_timeout)
        except Exception as e:
            logger.warning("Could not look for replicas of blocks %d:%d (%r); starting from the checkpoint", start,
                           end, e)
            return
        replicas = [r.peer_id for r in records if (r.start, r.end) == (start, end) and r.state == PeerState.ONLINE
                    and r.peer_id != str(self.node.peer_id)]
        await training.start_from_replicas(replicas, self.config.request_timeout)

    async def _choose_blocks(self) -> tuple[int, int]:
        if self.config.block_indices is not None:
            return self.config.block_indices
        records = await asyncio.wait_for(fetch_records(self.node, self.model_name), self.config.swarm.dht_timeout)
        start, end = choose_blocks(records, self.model_config.num_layers, self.config.num_blocks)
        logger.info("Chose blocks %d:%d, the least served in a swarm of %d peers", start, end, len(records))
        return start, end

    def _measure(self, blocks) -> Compute:
        """Forward and backward seconds per token of one block on our device (a 128-token forward), cached."""
        cfg = self.model_config
        key = (f"{cfg.family}-h{cfg.hidden_size}-i{cfg.intermediate_size}-kv{cfg.num_kv_heads}"
               f"-{self.device}-{self.dtype}")

        def measure() -> Compute:
            logger.info("Measuring the forward and backward compute of one block (cached in %s)",
                        self.config.cache_dir)
            return measure_block(blocks[0], cfg.hidden_size, self.device, self.dtype)

        t0 = time.perf_counter()
        value = cached_compute(self.config.cache_dir, key, measure)
        logger.debug("Compute per token per block: forward %.3g ms, backward %.3g ms (%.2f s)", value.forward * 1e3,
                     value.backward * 1e3, time.perf_counter() - t0)
        return value

    def _make_record(self, peer_id: str, start: int, end: int) -> PeerRecord:
        return PeerRecord(
            peer_id=peer_id, model=self.model_name, start=start, end=end, state=PeerState.JOINING,
            throughput=0.0, device=str(self.device), dtype=str(self.dtype).removeprefix("torch."),
            public_name=self.config.public_name, version=peers.__version__,
            addresses=(), max_batch_size=self.config.max_batch_size,
        )

    def _make_info(self, peer_id: str, start: int, end: int, throughput: float) -> StageInfo:
        cfg = self.model_config
        return StageInfo(
            peer_id=peer_id, model=self.model_name, start=start, end=end, hidden_size=cfg.hidden_size,
            dtype=str(self.dtype).removeprefix("torch."), max_batch_size=self.config.max_batch_size,
            max_seq_len=cfg.max_position_embeddings, max_request_bytes=self.config.max_request_bytes,
            throughput=float(throughput), version=peers.__version__, cache_tokens=self.config.cache_tokens,
            cache_tokens_free=self.config.cache_tokens, session_timeout=self.config.session_timeout,
        )


def measure_block(block, hidden_size: int, device: torch.device, dtype: torch.dtype,
                  tokens: int = MEASURE_TOKENS) -> Compute:
    """Median forward and backward time of ``block`` on ``tokens`` tokens, per token. The backward is that of the
    block's input and weights (as in training); the weights' grads are cleared and frozen again afterwards."""
    hidden = torch.randn(1, tokens, hidden_size, device=device, dtype=dtype)
    positions = torch.arange(tokens, device=device)[None]

    def synced(fn):  # a GPU runs kernels asynchronously: time them to their end, not to their launch
        if device.type != "cuda":
            return fn
        return lambda: (fn(), torch.cuda.synchronize(device))

    with torch.inference_mode():
        forward = time_per_call(synced(lambda: block(hidden, positions)))
    params = list(block.parameters())
    frozen = [not p.requires_grad for p in params]
    x = hidden.clone().requires_grad_(True)

    def forward_backward() -> None:
        out, _ = block(x, positions)
        out.float().sum().backward()

    try:
        for p in params:
            p.requires_grad_(True)
        with torch.enable_grad():
            both = time_per_call(synced(forward_backward), repeats=3)
            graph_forward = time_per_call(synced(lambda: block(x, positions)), repeats=3)
    finally:
        for p, was_frozen in zip(params, frozen, strict=True):
            p.grad = None
            if was_frozen:
                p.requires_grad_(False)
    backward = max(both - graph_forward, forward / 10)  # never 0: a noisy difference of two timings
    return Compute(forward / tokens, backward / tokens)


async def _quietly(coro, what: str) -> None:
    """A shutdown step that may fail when the p2p daemon is already gone (Ctrl-C reaches it too)."""
    try:
        await asyncio.wait_for(coro, timeout=10)
    except Exception as e:
        logger.info("Could not %s (%s); the p2p daemon may have stopped first. Our record expires by itself.",
                    what, type(e).__name__)


async def _stop_background(gathered: asyncio.Future) -> None:
    """Cancel the gathered background tasks and wait for them, retrieving the outcome (no "never retrieved" log)."""
    gathered.cancel()
    await asyncio.wait([gathered])
    if not gathered.cancelled():
        gathered.exception()  # the cancellation itself, or an error the caller already raised


async def _reap_forever(sessions: SessionRegistry) -> None:
    """Free sessions whose client went away, a few times per timeout."""
    while True:
        await asyncio.sleep(max(0.2, sessions.timeout / 4))
        sessions.reap()
