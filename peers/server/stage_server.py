"""``StageServer``, the composition root of a peer: DHT node, blocks, handler, announcer; and its moves.

A peer serves one span at a time (a ``_Stage``: blocks, backend, sessions, training side). ``move_to`` loads another
span while the old one keeps serving (blocks it already holds are kept, the rest read from the model folder on a
thread; with training on, the newest checkpoint of that exact span wins, else blocks other peers serve are fetched
with their trained weights, ``ParamsFetch`` of a sub-range of their span), then switches in one go on the event loop:
from the next request on, every stream serves the new span, and a request for the old one gets a ``moved:`` refusal
(``peers.wire.errors.MovedError``: clients re-route it without a ban). A step already running on the old span
finishes; a training run open on it is checkpointed and dropped first (its trainer's next call gets ``moved:`` and
chooses its stages again). The record is re-announced at once with the new span (links are kept: nothing is
re-probed). ``become_backup`` does the same with no new span: it frees the blocks and announces ``BACKUP``. A move
that fails (bad span, no memory, a broken checkpoint) leaves the peer serving its old span and says why.

A backup's record (``PeerState.BACKUP``) names span ``0:N``, N = the blocks it could take (its ``max_blocks``, at most
the model's): records must keep ``0 <= start < end``, and it serves none of them; routing, block coverage and
stage choice only count ``ONLINE`` records.
"""

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
from peers.core.devices import resolve_device, resolve_dtype
from peers.core.ids import DTYPES
from peers.core.progress import load_progress
from peers.model import ModelConfig, StageBlocks, load_blocks
from peers.server.adapter_runs import AdapterRuns
from peers.server.backend import StageBackend
from peers.server.block_timing import compute_key, measure_block, measure_loaded_block
from peers.server.chain_calls import ChainCalls
from peers.server.control import close_control, serve_control
from peers.server.handler import StageHandler
from peers.server.kv_sessions import SessionRegistry
from peers.server.memory import block_bytes, free_bytes, holdable_blocks
from peers.server.metrics import serve_metrics
from peers.server.plan_follower import plan_following
from peers.server.prober import LinkProber
from peers.server.retiming import start_retiming
from peers.server.span_loading import assemble, fetch_trained, has_checkpoint, load_new_blocks
from peers.server.training_rpc import TrainingRPC
from peers.wire.errors import moved_refusal
from peers.wire.links import PeerLinks
from peers.wire.messages import StageInfo
from swarm.announcer import Announcer
from swarm.block_selection import choose_blocks
from swarm.discovery import fetch_records, lan_presence, start_node, visible_maddrs
from swarm.keys import check_model_name
from swarm.lan import FIND_WAIT, find_swarm
from swarm.links import LinkTable
from swarm.measure import Compute, cached_compute
from swarm.records import PeerRecord, PeerState
from swarm.revocations import check_membership, keep_revocations, serve_until

logger = logging.getLogger(__name__)

@dataclasses.dataclass(eq=False)
class _Stage:
    """What serves one span: its blocks on a batching backend, its inference sessions and its training side."""

    start: int
    end: int
    blocks: StageBlocks
    backend: StageBackend
    sessions: SessionRegistry
    info: StageInfo
    training: TrainingRPC | None


class StageServer:
    """Loads a contiguous range of blocks, measures them, announces itself and serves until stopped; moves to
    another span (``move_to``) or becomes a backup (``become_backup``) on request."""

    def __init__(self, config: StageServerConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model_dir)
        self.model_name = check_model_name(config.model_name or self.model_config.name)
        self.device = torch.device(resolve_device(config.device))
        self.dtype = DTYPES[resolve_dtype(config.torch_dtype, self.model_config.torch_dtype, self.device)]
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
        self.max_blocks = 0  # blocks our memory holds (announced); set at start
        self._stage: _Stage | None = None  # None: a backup
        self._moving: asyncio.Lock | None = None
        self._retiring: set[asyncio.Task] = set()  # old spans finishing their work before they are freed

    @property
    def span(self) -> tuple[int, int] | None:
        """The blocks ``[start, end)`` this peer serves now; None while it is a backup (or not started)."""
        return (self._stage.start, self._stage.end) if self._stage is not None else None

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set, then leave cleanly (announce offline, stop the daemon)."""
        swarm = self.config.swarm
        self.identity = load_identity(swarm)  # our peer id; signs our handshakes
        self.admission = load_admission(swarm, self.identity)  # who may call us; signs and seals our records
        self._moving = asyncio.Lock()
        initial_peers = swarm.initial_peers
        if swarm.lan and not swarm.new_swarm:  # no --initial_peers: the swarm on the LAN
            initial_peers = tuple(await find_swarm(swarm.host_maddrs))
            if not initial_peers:
                raise ValueError(
                    f"no swarm answered on the LAN within {FIND_WAIT:g} s (mDNS on {' '.join(swarm.host_maddrs)}): "
                    f"pass --initial_peers (the line `swarm dht` printed), or --new_swarm to start one here "
                    f"(advertised on the LAN); to be found by other machines, listen with --host_maddrs "
                    f"/ip4/0.0.0.0/tcp/0")
            logger.info("Found %d node address(es) on the LAN (mDNS)", len(initial_peers))
        self.node = await start_node(
            initial_peers=initial_peers,
            host_maddrs=swarm.host_maddrs,
            announce_maddrs=swarm.announce_maddrs,
            identity=self.identity,
            identity_path=swarm.identity_path,  # locked while we run: a second peer with it is refused
            record_validator=self.admission.record_validator(),
            client_mode=swarm.client_mode, nat=swarm.nat(),
            check_reachability=swarm.check_reachability,  # others must dial us (directly or through a relay)
        )
        self.announcer = handler = reaper = self.links = probing = control = lan = retiming = None
        try:
            if swarm.lan:  # advertised on the LAN; meets nodes that started their own swarm there at the same time
                lan = await lan_presence(self.node, swarm.host_maddrs)
            peer_id = self.peer_id = str(self.node.peer_id)
            self.max_blocks = self._memory_blocks()
            if self.config.backup:
                start, end = 0, self._backup_blocks()
            else:
                start, end = await self._choose_blocks()
                self.max_blocks = max(self.max_blocks, end - start)
            self.announcer = Announcer(
                self.node, self._make_record(peer_id, start, end), period=self.config.update_period,
                check=lambda: check_membership(self.admission),
                refresh=lambda r: dataclasses.replace(r, links=self.link_table.best_rows(), **self._cache_use()))
            await self.announcer.start()  # JOINING: other joining peers see our blocks and choose others
            self.links = PeerLinks(self.node.p2p, self.admission, timeout=self.config.request_timeout,
                                   observe=self.link_table.observe)
            if self.config.backup:  # warm up: measured and linked, ready to move; no blocks loaded
                compute = None if self.config.throughput else self._measure(None)
                self.throughput = self.config.throughput or 1.0 / compute.forward  # type: ignore[union-attr]
                info = self._make_info(peer_id, start, end, self.throughput)
                handler = self._make_handler(None, info, self._sessions(), None)
                handler.switch(None, info, handler.sessions, None, left=None, unserved=moved_refusal(None, None))
            else:
                logger.info("Loading blocks %d:%d of %s", start, end, self.model_name)
                with load_progress(end - start, f"Loading blocks {start}:{end}") as advance:
                    blocks = load_blocks(self.config.model_dir, start, end, device=self.device, dtype=self.dtype,
                                         progress=advance)
                compute = None if self.config.throughput else self._measure(blocks)
                self.throughput = self.config.throughput or 1.0 / compute.forward  # type: ignore[union-attr]
                self._stage = await self._make_stage(blocks, start, end)
                if self._stage.training is not None and self._stage.training.trainers.enabled:
                    await self._fetch_from_replica(self._stage.training, start, end)
                stage = self._stage
                handler = self._make_handler(stage.backend, stage.info, stage.sessions, stage.training)
            self.handler = handler
            reaper = asyncio.gather(self._reap_forever(), keep_revocations(  # they raise if we are shut out
                self.node, self.admission, period=self.config.update_period), self.announcer.wait(),
                *plan_following(self))  # moves this peer to its place in the plan it trusts (--no_follow: none)
            await handler.add_p2p_handlers(self.node.p2p)
            addresses = tuple(await visible_maddrs(self.node))  # announced or relayed ones (swarm.discovery)
            self.announcer.update(state=PeerState.BACKUP if self.config.backup else PeerState.ONLINE,
                                  throughput=self.throughput, addresses=addresses,
                                  forward_seconds=compute.forward if compute else 0.0,
                                  backward_seconds=compute.backward if compute else 0.0)
            self.record = self.announcer.record
            probing = asyncio.create_task(self._prober(peer_id, self.links, self.announcer).run())
            if compute is not None:  # timed (not --throughput): timed again while idle, the fastest announced
                retiming = start_retiming(self, compute, compute_key(self.model_config, self.device, self.dtype))
            if self.config.control_socket is not None:
                control = await serve_control(self.config.control_socket, self)
            if self.config.metrics_port:
                serve_metrics(self, self.config.metrics_port, self.config.metrics_host)
            if self.config.backup:
                logger.info("Backup peer %s of %s ready (up to %d blocks, %.0f tokens/s per block): no blocks "
                            "loaded until it is moved; addresses: %s", peer_id, self.model_name, self.max_blocks,
                            self.throughput, " ".join(addresses))
            else:
                logger.info(
                    "Serving blocks %d:%d of %s as peer %s (%.0f tokens/s per block); addresses: %s",
                    start, end, self.model_name, peer_id, self.throughput, " ".join(addresses),
                )
            self.ready.set()
            await serve_until(stop, reaper)  # or raise MembershipError: our certificate was revoked or expired
            logger.info("Shutting down: announcing offline")
        finally:
            if lan is not None:
                await _quietly(lan.close(), "stop advertising on the LAN")
            if control is not None:
                await close_control(control, self.config.control_socket)  # type: ignore[arg-type]
            if probing is not None:
                probing.cancel()
                await asyncio.gather(probing, return_exceptions=True)
            if retiming is not None:
                retiming.cancel()
                await asyncio.gather(retiming, return_exceptions=True)
            if self.announcer is not None:
                await _quietly(self.announcer.stop(PeerState.OFFLINE), "announce offline")
            if handler is not None:
                await _quietly(handler.remove_p2p_handlers(self.node.p2p), "remove handlers")
            if reaper is not None:
                await _stop_background(reaper)
            for task in list(self._retiring):
                await asyncio.gather(task, return_exceptions=True)
            if self._stage is not None:
                await _close_stage(self._stage)
            if self.links is not None:
                self.links.close()
            await _quietly(self.node.shutdown(), "stop the DHT node")
            logger.info("Stopped")

    # ---- moves ------------------------------------------------------------------------------------
    async def move_to(self, start: int, end: int) -> None:
        """Serve blocks ``[start, end)`` instead of the current span (or, for a backup, at all).

        Loads the new blocks while the old ones keep serving (nothing new is announced meanwhile), then switches at
        once: the new backend, info, sessions and training side serve every stream's next request, requests for the
        old span get a ``moved:`` refusal, the old span's running steps finish and its blocks are freed; the record
        is announced ``ONLINE`` with the new span. ``ValueError`` for a span beyond the model or beyond
        ``max_blocks``; a load that fails leaves the old span serving and raises ``RuntimeError`` saying why."""
        n = self.model_config.num_layers
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= n):
            raise ValueError(f"cannot move to blocks {start}:{end}: this model has blocks 0:{n} (need 0 <= START < "
                             f"END <= {n})")
        if end - start > self.max_blocks:
            raise ValueError(f"cannot move to blocks {start}:{end}: that is {end - start} blocks, and this peer holds "
                             f"at most {self.max_blocks} (--max_blocks, or what its free memory holds)")
        if not self.ready.is_set() or self._moving is None:
            raise RuntimeError("this peer is not serving yet: move it once it is ready")
        async with self._moving:
            old = self._stage
            if old is not None and (old.start, old.end) == (start, end):
                return
            left = (old.start, old.end) if old is not None else None
            logger.info("Moving to blocks %d:%d%s: loading them while the old span keeps serving", start, end,
                        f" (from {left[0]}:{left[1]})" if left else " (a backup until now)")
            began = time.perf_counter()
            try:
                have = range(old.start, old.end) if old is not None else range(0)
                fresh = await asyncio.to_thread(load_new_blocks, self.config.model_dir, start, end, have,
                                                device=self.device, dtype=self.dtype)
                fetched = await self._fetch_trained(fresh, start, end)
            except Exception as e:
                still = f"blocks {left[0]}:{left[1]}" if left else "nothing (a backup)"
                logger.error("Could not move to blocks %d:%d: %s: %s. Still serving %s; free memory, check the model "
                             "folder and checkpoints (or --max_blocks), then try again", start, end, type(e).__name__,
                             e, still)
                raise RuntimeError(f"could not load blocks {start}:{end} ({type(e).__name__}: {e}); this peer still "
                                   f"serves {still}") from e
            refusal = moved_refusal((start, end), left)
            carried = await self._retire_training(old, refusal)  # checkpoint the run of the old span, drop it
            try:
                blocks = assemble(fresh, start, end, old.blocks if old is not None else (),
                                  old.start if old is not None else start,
                                  copy_kept=self.config.trainer_policy().enabled)
                stage = await self._make_stage(blocks, start, end, moved=refusal,
                                               carried_step=max(carried, fetched))
            except Exception as e:
                logger.error("Could not move to blocks %d:%d: %s: %s. Still serving %s for inference (its training "
                             "run was closed); try again", start, end, type(e).__name__, e, left)
                raise RuntimeError(f"could not set up blocks {start}:{end}: {type(e).__name__}: {e}") from e
            self._switch(old, stage, refusal)
            await self._announce(PeerState.ONLINE, start, end)
            logger.info("Serving blocks %d:%d of %s as peer %s (moved%s in %.1f s)", start, end, self.model_name,
                        self.peer_id, f" from {left[0]}:{left[1]}" if left else " from backup",
                        time.perf_counter() - began)

    async def become_backup(self) -> None:
        """Stop serving (requests for the old span get ``moved:``; running steps finish), free the blocks and
        announce ``BACKUP`` (span ``0:N``, N the blocks it could take): ready for ``move_to``."""
        if not self.ready.is_set() or self._moving is None:
            raise RuntimeError("this peer is not serving yet")
        async with self._moving:
            old = self._stage
            if old is None:
                return
            refusal = moved_refusal(None, (old.start, old.end))
            await self._retire_training(old, refusal)
            info = self._make_info(self.peer_id, 0, self._backup_blocks(), self.throughput)
            self._stage, chain = None, self.handler.inference.chain
            self.handler.switch(None, info, self._sessions(), None, left=(old.start, old.end), unserved=refusal)
            self._retire(old, chain, refusal)
            await self._announce(PeerState.BACKUP, 0, self._backup_blocks())
            logger.info("Backup peer %s of %s: stopped serving blocks %d:%d and freed them; ready to move",
                        self.peer_id, self.model_name, old.start, old.end)

    async def _fetch_trained(self, fresh: dict[int, torch.nn.Module], start: int, end: int) -> int:
        """With training on and no checkpoint of exactly ``[start, end)``, the fresh blocks take the trained weights
        their peers hold now (``span_loading.fetch_trained``); the highest step fetched (0: none)."""
        if not fresh or not self.config.trainer_policy().enabled or has_checkpoint(self.config.checkpoint_dir, start,
                                                                                   end):
            return 0
        return await fetch_trained(fresh, node=self.node, model_name=self.model_name, peer_id=self.peer_id,
                                   stream_for=self.links.get, dht_timeout=self.config.swarm.dht_timeout,  # type: ignore
                                   request_timeout=self.config.request_timeout)

    async def _retire_training(self, old: _Stage | None, refusal: str) -> int:
        """Checkpoint and drop the training run open on the span we leave; the step of the weights it leaves us."""
        if old is None or old.training is None:
            return 0
        step = old.training.step
        await old.training.retire(refusal)
        return step

    def _switch(self, old: _Stage | None, new: _Stage, refusal: str) -> None:
        """From the next request on, every stream serves ``new``; ``old`` finishes its running work (no await here:
        nothing runs in between)."""
        self._stage = new
        chain = self.handler.inference.chain if old is not None else None  # the old span's chained steps
        if old is not None:
            new.sessions.moved = {session_id: refusal for session_id in old.sessions.sessions}
        self.handler.switch(new.backend, new.info, new.sessions, new.training,  # a backup: the span it served last
                            left=(old.start, old.end) if old is not None else self.handler.left)
        if old is not None:
            self._retire(old, chain, refusal)

    def _retire(self, old: _Stage, chain: ChainCalls | None, refusal: str) -> None:
        """Mark the old span's sessions moved (their later steps get ``refusal``), fail its steps waiting for pushes,
        and free the span once its running work is done."""
        for session in old.sessions.sessions.values():
            session.moved = refusal
        if chain is not None:
            chain.retire(refusal)
        task = asyncio.create_task(self._free(old))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _free(self, old: _Stage) -> None:
        if not await old.backend.drain(self.config.request_timeout):
            logger.warning("Blocks %d:%d: %d request(s) still running after %.0f s; freeing the blocks anyway",
                           old.start, old.end, old.backend.in_flight, self.config.request_timeout)
        await _close_stage(old)
        old.sessions.sessions.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        logger.info("Freed blocks %d:%d", old.start, old.end)

    async def _announce(self, state: PeerState, start: int, end: int) -> None:
        assert self.announcer is not None
        await self.announcer.publish(state=state, start=start, end=end, max_blocks=self.max_blocks)
        self.record = self.announcer.record

    def _cache_use(self) -> dict[str, int]:
        """The record's cache figures now (none for a backup: it holds no cache)."""
        sessions = self._stage.sessions if self._stage is not None else None
        return {} if sessions is None else {"cache_tokens": sessions.cache_tokens, "cache_used": sessions.tokens_used}

    # ---- building a span --------------------------------------------------------------------------
    def _sessions(self) -> SessionRegistry:
        return SessionRegistry(cache_tokens=self.config.cache_tokens, timeout=self.config.session_timeout,
                               max_length_limit=self.model_config.max_position_embeddings,
                               client_share=self.config.client_cache_share, cache_wait=self.config.cache_wait)

    async def _make_stage(self, blocks: StageBlocks, start: int, end: int, *, moved: str = "",
                          carried_step: int = 0) -> _Stage:
        sessions = self._sessions()
        backend = StageBackend(
            blocks, start=start, device=self.device, dtype=self.dtype,
            max_batch_tokens=self.config.max_batch_tokens, active_sessions=sessions.attached_count,
        )
        info = self._make_info(self.peer_id, start, end, self.throughput)
        training = self._training(blocks, info, moved=moved, carried_step=carried_step)
        await backend.launch()
        return _Stage(start, end, blocks, backend, sessions, info, training)

    def _make_handler(self, backend, info: StageInfo, sessions: SessionRegistry, training) -> StageHandler:
        return StageHandler(backend, info, sessions, request_timeout=self.config.request_timeout,
                            identity=self.identity, require_encryption=self.config.require_encryption,
                            admission=self.admission, training=training,
                            stream_for=self.links.get)  # type: ignore[union-attr]

    async def _reap_forever(self) -> None:
        """Free sessions whose client went away, a few times per timeout (those of the span served now)."""
        while True:
            await asyncio.sleep(max(0.2, self.config.session_timeout / 4))
            if self._stage is not None:
                self._stage.sessions.reap()

    def _prober(self, peer_id: str, links: PeerLinks, announcer: Announcer) -> LinkProber:
        """Probes the other peers of our model that we know nothing of, and publishes our best links."""
        async def fetch() -> list[PeerRecord]:
            return await asyncio.wait_for(fetch_records(self.node, self.model_name), self.config.swarm.dht_timeout)

        def publish(rows, wake: bool) -> None:  # each announcement refreshes the rows; new probes: announce now
            announcer.update(links=rows, wake=wake)
            self.record = announcer.record

        return LinkProber(self.link_table, links.get, fetch, peer_id, publish, largest=self.config.probe_max_bytes)

    def _training(self, blocks, info: StageInfo, *, moved: str = "", carried_step: int = 0) -> TrainingRPC | None:
        """The training side, if the operator allows trainers (``--trainers``): it trains the weights we serve. After
        a move, the newest checkpoint of exactly this span wins over the weights carried over or fetched."""
        policy, adapters = self.config.trainer_policy(), self.config.adapter_policy()
        if not policy.enabled and not moved:
            logger.info("Training of these blocks is off: pass --trainers PEER_ID[,...] (or members, or anyone) to "
                        "let trainers train them%s", f"; adapter runs allowed for {adapters.describe()}"
                        if adapters.enabled else "")
        if not policy.enabled and not adapters.enabled:
            return None
        if not moved and policy.anyone:
            logger.warning("--trainers anyone: %s may train these blocks, and every client then computes with what "
                           "it trained", policy.describe())
        elif not moved:
            logger.info("Training allowed for %s", policy.describe())
        def side(adapter_mode: bool = False) -> TrainingRPC:
            return TrainingRPC(blocks, info, trainers=policy, checkpoint_dir=self.config.checkpoint_dir,
                               stream_for=self.links.get,  # type: ignore[union-attr]
                               chain_timeout=self.config.request_timeout, links=self.link_table,
                               adapter_mode=adapter_mode)

        training = side()
        training.adapter_runs = AdapterRuns(lambda: side(adapter_mode=True), adapters, blocks)  # LoRA (issue 19)
        training.moved = moved
        if not policy.enabled:  # adapters only: the blocks are the model's, never trained here
            return training
        if training.resume_latest() is None and carried_step:  # our own checkpoint first, else what we carried
            training.carried_step = training.fetched_step = carried_step
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

    def _memory_blocks(self) -> int:
        """``--max_blocks``, else the blocks our free memory holds (before we load any)."""
        if self.config.max_blocks is not None:
            return self.config.max_blocks
        per_block = block_bytes(self.model_config, self.dtype)
        held = holdable_blocks(free_bytes(self.device), per_block, num_layers=self.model_config.num_layers,
                               training=self.config.trainer_policy().enabled)
        logger.info("Memory holds about %d block(s) of %.1f MiB (%s, %s); announced as max_blocks (--max_blocks "
                    "overrides)", held, per_block / 2**20, self.device, str(self.dtype).removeprefix("torch."))
        return held

    def _backup_blocks(self) -> int:
        """The span a backup's record names: ``0:N``, N the blocks it could take."""
        return max(1, min(self.max_blocks, self.model_config.num_layers))

    def _measure(self, blocks) -> Compute:
        """Forward and backward seconds per token of one block on our device (a 128-token forward), cached. A
        backup (``blocks`` None) loads block 0 for it and frees it again."""
        cfg = self.model_config
        key = compute_key(cfg, self.device, self.dtype)

        def measure() -> Compute:
            logger.info("Measuring the forward and backward compute of one block (cached in %s)",
                        self.config.cache_dir)
            if blocks is None:
                return measure_loaded_block(self.config.model_dir, cfg.hidden_size, self.device, self.dtype)
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
            addresses=(), max_batch_size=self.config.max_batch_size, max_blocks=self.max_blocks,
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


async def _close_stage(stage: _Stage) -> None:
    await stage.backend.shutdown()
    if stage.training is not None and not stage.training.retired:
        stage.training.shutdown()  # finishes the running computation first
        stage.training.save_unsaved()
        if stage.training.adapter_runs is not None:
            stage.training.adapter_runs.save_all("before leaving")


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
