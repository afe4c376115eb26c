"""``SwarmClient``: embeddings and head run here; the blocks run on a chain of peers found in the DHT."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import torch
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from peers.client.adapters import ClientAdapter
from peers.client.chain_session import ChainSession
from peers.client.generation import SamplingConfig, generate_stream
from peers.client.inference_session import InferenceSession
from peers.client.retry import backoff, classify, report_failure
from peers.core.access import load_admission, load_identity
from peers.core.aio import BackgroundLoop
from peers.core.config import ClientConfig, SwarmConfig
from peers.core.devices import resolve_device, resolve_dtype
from peers.core.ids import DTYPES
from peers.model import ModelConfig, load_blocks, load_client_parts
from peers.model.hub import resolve_model
from peers.training.state import client_part, load_weights, trainer_part_dir
from peers.wire.errors import MovedError, RequestError
from peers.wire.links import PeerLinks
from peers.wire.messages import InfoRequest, StageInfo
from peers.wire.service import StageService
from peers.wire.stream import PeerStream
from privacy.admission import proof_context
from privacy.errors import MembershipError
from privacy.peer_ids import public_key_of
from swarm.discovery import Snapshot, fetch_plans, fetch_records, start_node
from swarm.estimator import ModelShape
from swarm.keys import check_model_name
from swarm.plan.types import Plan
from swarm.records import PeerRecord
from swarm.revocations import keep_revocations
from swarm.routing import NoRouteError, Router

logger = logging.getLogger(__name__)


class SwarmClient:
    """Runs a model whose blocks are served by the swarm.

    ``forward(input_ids)`` returns the same logits as the whole model in one process: token ids and logits
    never leave this machine; only hidden states travel to the peers.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        initial_peers: tuple[str, ...] | list[str] = (),
        config: ClientConfig | None = None,
    ) -> None:
        if config is None:
            config = ClientConfig(swarm=SwarmConfig(initial_peers=tuple(initial_peers)))
        elif initial_peers:
            raise ValueError("pass initial_peers either directly or in config.swarm, not both")
        if not config.swarm.initial_peers:
            raise ValueError("SwarmClient needs initial_peers: the line `swarm dht` printed")
        self.config, self.model_dir = config, resolve_model(model_dir)  # a folder, or a hub id in the HF cache
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.model_name = check_model_name(config.model_name or self.model_config.name)
        self.device = torch.device(resolve_device(config.device))
        self.dtype = DTYPES[resolve_dtype(config.torch_dtype, self.model_config.torch_dtype, self.device)]
        self.embedding, self.head = load_client_parts(self.model_dir, device=self.device, dtype=self.dtype)
        if config.checkpoint is not None:  # a training run's embedding + head (its blocks are on the peers)
            info = load_weights(trainer_part_dir(config.checkpoint), client_part(self.embedding, self.head))
            logger.info("Running the embedding and head of run %r at step %s from %s", info.get("run_id"),
                        info.get("steps_done"), config.checkpoint)
        self.adapter = ClientAdapter(config.adapter)  # LoRA adapters the peers run our requests with (issue 19)
        if config.adapter and config.local_blocks:
            raise ValueError("adapters run on the peers only: use local_blocks=0 with an adapter")
        if not 0 <= config.local_blocks < self.model_config.num_layers:
            raise ValueError(f"local_blocks must be in 0..{self.model_config.num_layers - 1}")
        self.first_remote = config.local_blocks  # blocks [0, first_remote) run here, the rest on peers
        self.local_blocks = (
            load_blocks(self.model_dir, 0, config.local_blocks, device=self.device, dtype=self.dtype)
            if config.local_blocks else None
        )
        self.identity = load_identity(config.swarm)  # our peer id: peers check our membership proofs against it
        self.admission = load_admission(config.swarm, self.identity)
        self._loop = BackgroundLoop()
        try:
            self.node = self._loop.run(
                start_node(
                    initial_peers=config.swarm.initial_peers,
                    host_maddrs=config.swarm.host_maddrs,
                    identity=self.identity,
                    client_mode=True,  # a client only dials out (also from behind NAT); relays reach peers behind NAT
                    record_validator=self.admission.record_validator(),
                    nat=config.swarm.nat(),
                ),
                timeout=60,
            )
        except BaseException:
            self._loop.close()
            raise
        # a private swarm: apply the owner's revocations and keep spreading them, like every member (no-op if public);
        # it ends with a MembershipError once our own certificate is revoked or expired, and every call raises it
        self._revocations = asyncio.run_coroutine_threadsafe(
            keep_revocations(self.node, self.admission, period=config.refresh_period), self._loop.loop)
        self.router = Router(
            self._fetch,
            model=self.model_name,
            refresh_period=config.refresh_period,
            ban_time=config.ban_time,
            max_ban_time=config.max_ban_time,
            fetch_plans=self._fetch_plans,  # a plan's groups: route along the one nearest us (swarm.plan.route)
            shape=ModelShape(self.model_config.hidden_size, self.model_config.num_layers,
                             torch.finfo(self.dtype).bits // 8),
            client_id=str(self.node.peer_id),
        )
        # every reply's timing, less the peer's reported compute, feeds the router's network estimates (passive)
        self._links = PeerLinks(self.node.p2p, self.admission, encrypt=config.encrypt,
                                timeout=config.request_timeout, observe=self.router.observe)

    # ---- synchronous API -------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]`` for ``input_ids`` ``[batch, seq]``, computed through the swarm."""
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {list(input_ids.shape)}")
        input_ids = input_ids.to(self.device)
        positions = torch.arange(input_ids.shape[1], device=self.device).expand_as(input_ids)
        hidden = self.embedding(input_ids, positions)
        if self.local_blocks is not None:
            hidden, _ = self.local_blocks(hidden, positions)
        hidden = self.run_blocks(hidden, self.first_remote)
        return self.head(hidden.to(self.device, self.dtype))

    def run_blocks(self, hidden: torch.Tensor, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Hidden states through blocks ``[start, end)`` of the swarm (all blocks by default)."""
        end = self.model_config.num_layers if end is None else end
        return self._loop.run(self.run_blocks_async(hidden, start, end))

    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        *,
        sampling: SamplingConfig | None = None,
        stop_tokens: Sequence[int] = (),
    ) -> torch.Tensor:
        """``[batch, prompt + new]`` token ids, generated through the swarm (greedy unless ``sampling``)."""
        new = list(self.iter_generate(input_ids, max_new_tokens, sampling=sampling, stop_tokens=stop_tokens))
        return torch.cat([input_ids.cpu(), torch.stack(new, dim=1)], dim=1) if new else input_ids.cpu()

    def iter_generate(
        self, input_ids: torch.Tensor, max_new_tokens: int, *, sampling: SamplingConfig | None = None,
        stop_tokens: Sequence[int] = (),
    ) -> Iterator[torch.Tensor]:
        """Yield each new token (``[batch]``) as it comes."""
        stream = generate_stream(self, input_ids, max_new_tokens, sampling or SamplingConfig(), stop_tokens)
        return self._loop.iterate(stream)

    def generate_stream(
        self, input_ids: torch.Tensor, max_new_tokens: int, *, sampling: SamplingConfig | None = None,
        stop_tokens: Sequence[int] = (),
    ) -> AsyncIterator[torch.Tensor]:
        """An async iterator of new tokens (``[batch]``), usable from any event loop."""
        stream = generate_stream(self, input_ids, max_new_tokens, sampling or SamplingConfig(), stop_tokens)
        return self._loop.aiterate(stream)

    def inference_session(self, *, max_length: int, batch_size: int = 1) -> InferenceSession:
        """An ``async with`` session for custom decoding loops (run it on ``client.loop``): a ``ChainSession`` (peers
        push their outputs to each other) or, with ``topology="star"``, an ``InferenceSession`` (all through us)."""
        cls = ChainSession if self.config.topology == "chain" else InferenceSession
        return cls(self, max_length=max_length, batch_size=batch_size)

    @property
    def loop(self):
        return self._loop

    def records(self) -> list[PeerRecord]:
        """A fresh snapshot of the swarm's peer records."""
        return self._loop.run(self._fetch())

    def wait_for_records(self, count: int, timeout: float = 60.0) -> list[PeerRecord]:
        """Wait until the swarm shows at least ``count`` peer records (announcements take a moment to spread)."""
        deadline = time.monotonic() + timeout
        while len(records := self.records()) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {len(records)} of {count} peers visible after {timeout:.0f} s; see `swarm status`"
                )
            time.sleep(0.5)
        return records

    def info(self, peer_id: str) -> StageInfo:
        return self._loop.run(self._info(peer_id))

    def close(self) -> None:
        if self._loop.loop.is_closed():
            return
        self._revocations.cancel()
        self._loop.loop.call_soon_threadsafe(self._links.close)
        try:
            self._loop.run(self.node.shutdown(), timeout=15)
        except Exception as e:
            logger.debug("Client shutdown: %s", e, exc_info=True)
        self._loop.close()

    def __enter__(self) -> SwarmClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- async internals -------------------------------------------------------------------------
    async def run_blocks_async(self, hidden: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Through a chain of peers; a failing peer is banned and its span re-routed (bounded retries). With
        ``topology="chain"`` the peers hand the hidden states to each other (a one-step ``ChainSession``), with
        ``"star"`` each hop's output comes back here (stateless forwards).

        A refusal (``RequestError``), being no member (``MembershipError``) or no route (``NoRouteError``: nobody
        serves a span, all its peers are banned or busy, or the swarm is private) is raised at once."""
        position, failures = start, 0
        hidden = hidden.detach().to("cpu", self.dtype)
        if self.config.topology == "chain":  # a one-step session down a chain of peers that push to each other
            async with ChainSession(self, max_length=hidden.shape[1], batch_size=hidden.shape[0],
                                    span=(start, end)) as session:
                return await session.step(hidden)
        while position < end:
            chain = await self.router.make_chain(position, end)
            for hop in chain:
                started = time.monotonic()
                try:
                    hidden = await self.call_forward(hop.peer_id, hidden, hop.start, hop.end)
                except (RequestError, MembershipError, NoRouteError) as e:
                    if not isinstance(e, MovedError):  # a peer that moved: re-route without a ban (below)
                        raise
                    failures += 1
                    report_failure(self.router, hop.peer_id, e, (hop.start, hop.end), started)
                    if failures > self.config.max_retries:
                        raise
                    break
                except Exception as e:
                    failures += 1
                    self.router.on_failure(hop.peer_id, e, started=started)
                    if failures > self.config.max_retries:
                        raise RuntimeError(
                            f"blocks {hop.start}:{hop.end} failed {failures} times (last: {e}); "
                            f"check `swarm status` and that peers serving them are reachable"
                        ) from e
                    await asyncio.sleep(backoff(failures))
                    break
                self.router.on_success(hop.peer_id)
                position = hop.end
        return hidden

    async def call_forward(self, peer_id: str, hidden: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Blocks ``[start, end)`` of ``peer_id`` on ``hidden``, over this client's (encrypted) stream to it.

        Raises ``RequestError`` if the peer refuses the request (``NotAdmittedError`` if as no member); a broken
        stream raises ``ConnectionError``.
        """
        stream = await self.peer_stream(peer_id)
        try:
            adapter = await self.adapter.name_for(stream, start, end, self.config.request_timeout)
            return await stream.forward(start, end, hidden, timeout=self.config.request_timeout,
                                        codec=self.config.codec, adapter=adapter)
        except RequestError as e:
            raise classify(e) from None

    async def peer_stream(self, peer_id: str) -> PeerStream:
        """This client's stream to ``peer_id`` (opened on first use, replaced once it breaks).

        ``MembershipError`` if our own certificate was revoked or expired, or the peer does not admit us."""
        self.check_membership()
        return await self._links.get(peer_id)

    def check_membership(self) -> None:
        """Raise ``MembershipError`` once this client learned (from the revocations it syncs) that its own
        certificate was revoked or has expired; nothing in a public swarm."""
        watch = self._revocations
        if watch.done() and not watch.cancelled() and isinstance(watch.exception(), MembershipError):
            raise MembershipError(str(watch.exception()))

    async def _info(self, peer_id: str) -> StageInfo:
        stub = StageService.get_stub(self.node.p2p, PeerID.from_base58(peer_id))
        proof = self.admission.proof(proof_context("rpc_info", public_key_of(peer_id)))
        request = runtime_pb2.ExpertRequest(metadata=InfoRequest(proof=proof).to_bytes())
        reply = await stub.rpc_info(request, timeout=self.config.request_timeout)
        return StageInfo.from_bytes(reply.serialized_info)

    async def _fetch_plans(self) -> list[Plan]:
        """The signed plans of our model (none if the DHT does not answer: routing then ignores plans)."""
        try:
            return await asyncio.wait_for(fetch_plans(self.node, self.model_name), self.config.swarm.dht_timeout)
        except Exception as e:
            logger.debug("Could not fetch plans (%r); routing without them", e)
            return []

    async def _fetch(self) -> Snapshot:
        """The swarm as this client may use it: only peers it trusts (``allowed_peers`` / ``blocked_peers``)."""
        self.check_membership()
        records = await asyncio.wait_for(fetch_records(self.node, self.model_name), self.config.swarm.dht_timeout)
        allowed, blocked = set(self.config.allowed_peers), set(self.config.blocked_peers)
        return Snapshot([r for r in records if (not allowed or r.peer_id in allowed) and r.peer_id not in blocked],
                        records.sealed)
