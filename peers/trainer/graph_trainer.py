"""``GraphTrainer``: trains (and runs) an operator graph whose stages are served by graph peers (``swarm peer
--graph``), in a star: every edge bundle goes through the trainer, which runs the loss (cross-entropy on the graph's
output) locally.

The trainer traces the graph itself (``GraphSpec``) for its edges and hash, finds peers announcing ``ARCH-HASH12``
whose node ranges tile the graph, and opens the run on each. A step is two-phase: each micro-batch's input edges go
to stage 0, its outputs on to stage 1, ..., the loss here, the gradients back stage by stage; when every micro-batch
is back, ``GraphApply`` commits the step on every stage (a stage holding another number refuses and drops it). Up to
``in_flight`` micro-batches are in the pipeline at once; each stage gets its forwards and its backwards in
micro-batch order, so BatchNorm's running statistics and the accumulated gradients equal one process's.

Several peers serving the same nodes are replicas of that stage (as for transformer stages): micro-batch ``i`` goes
to replica ``i mod R``, the gradient a replica gets is scaled by ``M / its share`` (its own mean: a full AdamW step
on its share) and scaled back on its way out, and the replicas average their weights every ``average_every`` steps
(``peers.server.graph_replicas``); a replica new to the run first copies the first replica's weights. A graph with
weights tied across stages (GPT-2) trains on one peer per stage.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from peers.core.access import load_admission, load_identity
from peers.core.aio import BackgroundLoop
from peers.core.config import SwarmConfig
from peers.model.graph.hashing import graph_hash
from peers.model.graph.registry import get_architecture
from peers.model.graph.stage import GraphStage, shared_parameters
from peers.model.graph.swarm_graph import GraphSpec, swarm_model_name
from peers.model.graph.trace import EdgeSpec, OpGraph
from peers.wire.edges import edge_codec
from peers.wire.errors import RequestError
from peers.wire.links import PeerLinks
from peers.wire.messages import GraphApply, GraphBackward, GraphFetch, GraphForward, GraphGrads, GraphOpen
from peers.wire.stream import LIVENESS_TIMEOUT, PeerStream
from swarm.discovery import fetch_records, start_node
from swarm.records import PeerRecord, PeerState

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GraphStagePeer:
    """A stage of the run: the peer and its node range, with the edges it takes and gives."""

    peer_id: str
    start: int
    end: int
    inputs: tuple[EdgeSpec, ...]
    outputs: tuple[EdgeSpec, ...]

    @property
    def grad_outputs(self) -> tuple[EdgeSpec, ...]:
        return tuple(s for s in self.outputs if s.dtype.is_floating_point)

    @property
    def grad_inputs(self) -> tuple[EdgeSpec, ...]:
        return tuple(s for s in self.inputs if s.dtype.is_floating_point)


def stage_replicas(records: Sequence[PeerRecord], chain: Sequence[tuple[str, int, int]]) -> list[list[str]]:
    """For each stage of ``chain``: its peer, then the other online peers serving exactly its nodes, by peer id."""
    online = [r for r in records if r.state == PeerState.ONLINE]
    return [[peer, *sorted({r.peer_id for r in online if (r.start, r.end) == (a, b)} - {peer})]
            for peer, a, b in chain]


def choose_stages(records: Sequence[PeerRecord], graph: OpGraph) -> list[tuple[str, int, int]]:
    """A chain of online peers whose node ranges tile ``[0, n)`` (the first at each position, by peer id);
    ``ValueError`` saying which ranges are served and what to start."""
    n = len(graph.order)
    online = sorted((r for r in records if r.state == PeerState.ONLINE), key=lambda r: (r.start, r.peer_id))
    chain, pos = [], 0
    while pos < n:
        here = [r for r in online if r.start == pos and r.end <= n]
        if not here:
            served = ", ".join(f"{r.start}:{r.end}" for r in online) or "none"
            raise ValueError(f"no peer serves nodes from {pos} of {graph.arch}'s {n} (served: {served}); start a peer "
                             f"with --graph {graph.arch} --graph_nodes {pos}:END, the same config and input shape")
        record = max(here, key=lambda r: r.end)
        chain.append((record.peer_id, record.start, record.end))
        pos = record.end
    return chain


class GraphTrainer:
    """Trains ``spec``'s graph on the swarm's graph peers; ``loss_fn(logits, targets)`` defaults to cross-entropy."""

    def __init__(self, spec: GraphSpec, swarm: SwarmConfig, *, optim: dict[str, Any] | None = None,
                 run_id: str = "graph-run", in_flight: int = 1, request_timeout: float = 60.0,
                 wait_peers: float = 60.0, liveness_timeout: float = LIVENESS_TIMEOUT, checkpoint_every: int = 0,
                 compression: str = "none", average_every: int = 1) -> None:
        if in_flight < 1:
            raise ValueError(f"in_flight must be at least 1, got {in_flight}")
        if average_every < 1:
            raise ValueError(f"average_every must be at least 1, got {average_every}")
        self.average_every = average_every  # replicas of a stage average their weights every this many steps
        if not swarm.initial_peers:
            raise ValueError("GraphTrainer needs initial_peers: the line `swarm dht` printed")
        self.spec, self.swarm, self.optim = spec, swarm, dict(optim or {})
        self.run_id, self.in_flight, self.timeout, self.wait_peers = run_id, in_flight, request_timeout, wait_peers
        self.checkpoint_every = checkpoint_every  # stages with a --checkpoint_dir save the run every this many steps
        try:  # how the run's edges travel both ways: none (bit-exact), fp16, bf16 or int8
            self.codec = edge_codec(compression)
        except RequestError as e:
            raise ValueError(str(e)) from None
        self.compression = "" if self.codec.exact else str(self.codec)
        self.graph = spec.trace()  # ValueError: unknown architecture, bad config
        self.graph_hash = graph_hash(self.graph)
        self.model_name = swarm_model_name(self.graph, self.graph_hash)
        self.input_name, self.output_name = self.graph.inputs[0], self.graph.outputs[0]
        self.kind = get_architecture(spec.arch).kind
        self.shared: list[dict[int, str]] = []
        self.stages: list[GraphStagePeer] = []  # the first replica of each stage
        self.replicas: list[list[GraphStagePeer]] = []  # every replica of each stage, the first first
        self.step = 0
        self.identity = load_identity(swarm)
        self.admission = load_admission(swarm, self.identity)
        self._loop = BackgroundLoop()
        try:
            self.node = self._loop.run(start_node(
                initial_peers=swarm.initial_peers, host_maddrs=swarm.host_maddrs, identity=self.identity,
                client_mode=True, record_validator=self.admission.record_validator(), nat=swarm.nat()), timeout=60)
        except BaseException:
            self._loop.close()
            raise
        self.links = PeerLinks(self.node.p2p, self.admission, timeout=request_timeout,
                               liveness_timeout=liveness_timeout)

    # ---- the run ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Find the stages (waiting up to ``wait_peers`` s for a tiling) and open the run on each."""
        self._loop.run(self._start(), timeout=self.wait_peers + 2 * self.timeout)

    def train_step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """One two-phase step over ``micro_batches`` of (inputs, targets): each micro-batch's cross-entropy
        (before the 1/M scaling of its gradient), in order."""
        if not self.stages:
            raise RuntimeError("call start() first")
        return self._loop.run(self._train_step(list(micro_batches)), timeout=self.timeout * (len(micro_batches) + 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Inference: the graph's output on ``x`` (each stage in eval mode; nothing kept, no run needed)."""
        if not self.stages:
            self._loop.run(self._find(), timeout=self.wait_peers + self.timeout)
        return self._loop.run(self._forward(x), timeout=self.timeout * (len(self.stages) + 1))

    def classify(self, x: torch.Tensor) -> torch.Tensor:
        """The class of each image of ``x`` (argmax of the logits)."""
        return self.forward(x).argmax(dim=-1)

    def fetch_state(self) -> dict[str, torch.Tensor]:
        """Every stage's parameters and buffers as they are on its peer now, by the model's keys."""
        if not self.stages:
            self._loop.run(self._find(), timeout=self.wait_peers + self.timeout)
        return self._loop.run(self._fetch_state(), timeout=self.timeout * (len(self.stages) + 1))

    def fetch_replica_state(self, stage: GraphStagePeer) -> dict[str, torch.Tensor]:
        """One replica's parameters and buffers (a stage of ``self.replicas``), by the model's keys."""
        return self._loop.run(self._fetch_state([stage]), timeout=2 * self.timeout)

    def stream(self, peer_id: str) -> PeerStream:
        """The trainer's encrypted stream to ``peer_id`` (for hand-made requests)."""
        return self._loop.run(self.links.get(peer_id), timeout=self.timeout)

    def run(self, coro: Any, timeout: float | None = None) -> Any:
        """Run a coroutine on the trainer's loop (for hand-made requests)."""
        return self._loop.run(coro, timeout=timeout or self.timeout)

    def close(self) -> None:
        if self._loop.loop.is_closed():
            return
        self._loop.loop.call_soon_threadsafe(self.links.close)
        try:
            self._loop.run(self.node.shutdown(), timeout=15)
        except Exception as e:
            logger.debug("Graph trainer shutdown: %s", e, exc_info=True)
        self._loop.close()

    def __enter__(self) -> GraphTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals --------------------------------------------------------------------------------
    async def _find(self) -> None:
        deadline = time.monotonic() + self.wait_peers
        while True:
            records = await asyncio.wait_for(fetch_records(self.node, self.model_name), self.swarm.dht_timeout)
            try:
                chain = choose_stages(list(records), self.graph)
                break
            except ValueError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
        self.shared = shared_parameters(self.graph, [s for _, s, _ in chain[1:]])  # tied weights across stages
        peers = stage_replicas(list(records), chain) if not self.shared else [[peer] for peer, _, _ in chain]
        self.replicas = [[GraphStagePeer(peer, a, b, self.graph.specs(self.graph.crossing(a)),
                                         self.graph.specs(self.graph.crossing(b))) for peer in group]
                         for group, (_, a, b) in zip(peers, chain, strict=True)]
        self.stages = [group[0] for group in self.replicas]
        logger.info("Graph %s: stages %s", self.model_name, " ".join(
            f"{s.start}:{s.end}" + (f"x{len(g)}" if len(g) > 1 else "") for s, g in zip(self.stages, self.replicas,
                                                                                      strict=True)))

    async def _start(self) -> None:
        await self._find()
        held = self._held()

        async def open_on(i: int, s: GraphStagePeer, source: str) -> int:
            group = [r.peer_id for r in self.replicas[i]]
            stream = await self.links.get(s.peer_id)
            reply, _ = await stream.call(GraphOpen(
                run_id=self.run_id, arch=self.graph.arch, graph_hash=self.graph_hash, start=s.start, end=s.end,
                optim=self.optim, shared=held.get(i, []), checkpoint_every=self.checkpoint_every,
                replicas=[p for p in group if p != s.peer_id], average_every=self.average_every, source=source),
                None, self.timeout)
            return reply.step

        # the first replicas first: the others copy their weights when the run is new to them
        firsts = await asyncio.gather(*(open_on(i, group[0], "") for i, group in enumerate(self.replicas)))
        others = await asyncio.gather(*(open_on(i, r, group[0].peer_id) for i, group in enumerate(self.replicas)
                                        for r in group[1:]))
        steps = {*firsts, *others}
        if len(steps) != 1:
            raise RuntimeError(f"the stages of run {self.run_id!r} are at different steps {sorted(steps)}: restart "
                               f"them from the same state")
        self.step = steps.pop()

    async def _forward(self, x: torch.Tensor) -> torch.Tensor:
        acts = {self.input_name: x}
        for s in self.stages:
            stream = await self.links.get(s.peer_id)
            request = GraphForward(arch=self.graph.arch, graph_hash=self.graph_hash, start=s.start, end=s.end,
                                   compression=self.compression)
            _, out = await stream.submit_bundle(request, acts, s.inputs, s.outputs, self.graph_hash, self.timeout,
                                                self.codec)
            assert out is not None
            acts = out
        return acts[self.output_name]

    async def _train_step(self, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        m, replicas = len(micro), self.replicas
        most = max(len(group) for group in replicas)
        if m < most:
            raise ValueError(f"a step needs at least as many micro-batches as a stage has replicas ({most}), got {m}")
        streams = [[await self.links.get(r.peer_id) for r in group] for group in replicas]
        shares = [[len(range(r, m, len(group))) for r in range(len(group))] for group in replicas]
        slots = asyncio.Semaphore(self.in_flight)
        fwd = [[asyncio.Event() for _ in range(m)] for _ in replicas]  # fwd[s][i]: micro i's forward queued at s
        bwd = [[asyncio.Event() for _ in range(m)] for _ in replicas]
        step = self.step

        async def one(i: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            micro_id = f"{step}.{i}"
            async with slots:
                acts: dict[str, torch.Tensor] = {self.input_name: x}
                route = [i % len(group) for group in replicas]  # micro-batch i's replica of each stage
                for k, group in enumerate(replicas):
                    s, stream = group[route[k]], streams[k][route[k]]
                    if i:
                        await fwd[k][i - 1].wait()
                    request = GraphForward(arch=self.graph.arch, graph_hash=self.graph_hash, start=s.start,
                                           end=s.end, run_id=self.run_id, micro_id=micro_id,
                                           compression=self.compression)
                    reply = stream.submit_bundle(request, acts, s.inputs, s.outputs, self.graph_hash, self.timeout,
                                                 self.codec)
                    fwd[k][i].set()
                    _, out = await reply
                    assert out is not None
                    acts = out
                logits = acts[self.output_name].requires_grad_()
                ce = self.loss(logits, y)
                (ce / m).backward()
                assert logits.grad is not None
                grads: dict[str, torch.Tensor] = {self.output_name: logits.grad}
                for k in reversed(range(len(replicas))):
                    s, stream = replicas[k][route[k]], streams[k][route[k]]
                    scale = m / shares[k][route[k]]  # the replica's own mean (1 without replicas)
                    if scale != 1:
                        grads = {name: g * scale if g.is_floating_point() else g for name, g in grads.items()}
                    if i:
                        await bwd[k][i - 1].wait()
                    back = GraphBackward(run_id=self.run_id, micro_id=micro_id, graph_hash=self.graph_hash,
                                         input_grads=k > 0, compression=self.compression)
                    reply = stream.submit_bundle(back, grads, s.grad_outputs, s.grad_inputs, self.graph_hash,
                                                 self.timeout, self.codec)
                    bwd[k][i].set()
                    _, got = await reply
                    grads = got or {}
                    if scale != 1:
                        grads = {name: g / scale if g.is_floating_point() else g for name, g in grads.items()}
                return ce.detach()

        tasks = [asyncio.ensure_future(one(i, x, y)) for i, (x, y) in enumerate(micro)]
        try:
            losses = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            raise
        payloads = await self._shared_grads([group[0] for group in streams], m)  # (tied weights: one replica)
        replies = await asyncio.gather(*(
            stream.submit_bundle(GraphApply(run_id=self.run_id, micro_batches=m, shared=list(payload)), payload,
                                 self._param_specs(list(payload)), (), self.graph_hash, self.timeout)
            if payload else stream.call(GraphApply(run_id=self.run_id, micro_batches=shares[k][r]), None,
                                        self.timeout)
            for k, (group, payload) in enumerate(zip(streams, payloads, strict=True))
            for r, stream in enumerate(group)))
        self.step = max(reply.step for reply, _ in replies)
        return list(losses)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy: of the classes (vision), or of each next token (a causal LM; ``targets``: the input ids)."""
        if self.kind == "causal_lm":
            return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets[:, 1:].reshape(-1))
        return F.cross_entropy(logits, targets)

    def _param_specs(self, names: list[str]) -> tuple[EdgeSpec, ...]:
        params = dict(self.graph.gm.named_parameters(remove_duplicate=False))
        return tuple(EdgeSpec(n, tuple(params[n].shape), params[n].dtype) for n in names)

    def _held(self) -> dict[int, list[str]]:
        """Stage -> the names under which it holds parameters shared with other stages."""
        held: dict[int, list[str]] = {}
        for names in self.shared:
            for i, name in names.items():
                held.setdefault(i, []).append(name)
        return held

    async def _shared_grads(self, streams: list[PeerStream], m: int) -> list[dict[str, torch.Tensor]]:
        """For each stage, the step's gradients of the parameters it shares with others: per micro-batch, the
        holders' parts added from the last stage to the first (as one process's backward adds the uses), then the
        micro-batches' sums in order (as its accumulation does); empty for a stage that shares none."""
        payloads: list[dict[str, torch.Tensor]] = [{} for _ in streams]
        held = self._held()
        parts: dict[int, dict[str, torch.Tensor]] = {}
        for i, names_i in held.items():
            specs = [EdgeSpec(f"{s.name}#{k}", s.shape, s.dtype) for k in range(m) for s in self._param_specs(names_i)]
            _, got = await streams[i].submit_bundle(GraphGrads(run_id=self.run_id, names=names_i), None, (), specs,
                                                    self.graph_hash, self.timeout)
            parts[i] = got or {}
        for names in self.shared:
            order = sorted(names.items(), reverse=True)
            total: torch.Tensor | None = None
            for k in range(m):
                part = parts[order[0][0]][f"{order[0][1]}#{k}"].clone()
                for i, name in order[1:]:
                    part += parts[i][f"{name}#{k}"]
                total = part if total is None else total + part
            for i, name in names.items():
                assert total is not None
                payloads[i][name] = total
        return payloads

    async def _fetch_state(self, stages: Sequence[GraphStagePeer] | None = None) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        for s in self.stages if stages is None else stages:
            module = GraphStage(self.graph, s.start, s.end, own=False).module
            specs = [EdgeSpec(k, tuple(v.shape), v.dtype) for k, v in module.state_dict().items()]
            stream = await self.links.get(s.peer_id)
            _, got = await stream.submit_bundle(GraphFetch(graph_hash=self.graph_hash), None, (), specs,
                                                self.graph_hash, self.timeout)
            state.update(got or {})
        return state
