"""The graph requests of a peer's stream (``GraphOpen``/``GraphForward``/``GraphBackward``/``GraphApply``/
``GraphFetch``), served by a ``GraphServing``. Forwards and backwards are followed by an edge bundle
(``peers.wire.edges``), read whole before anything is refused so that the stream stays in step; replies carry a
bundle whose context is the ``InferenceReply``. A refusal is one log line and changes nothing."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence

import torch
from hivemind.proto import runtime_pb2

from peers.core.aio import deadline
from peers.model.graph.trace import EdgeSpec
from peers.server.calls import Call, Responses, StreamCalls, reply
from peers.server.graph_runs import GraphServing
from peers.server.stream_handler import StreamHandler
from peers.wire.edges import edge_codec, edge_messages, read_edge_messages
from peers.wire.errors import RequestError
from peers.wire.messages import (
    GRAPH_BUNDLE_KINDS,
    GraphApply,
    GraphBackward,
    GraphFetch,
    GraphForward,
    GraphGrads,
    GraphOpen,
    InferenceReply,
    ParamsPush,
    StageInfo,
    unpack_inference,
)
from privacy.peer_ids import short_id
from swarm.compression.codecs import NONE, Codec

logger = logging.getLogger(__name__)

GRAPH_KINDS = (GraphOpen, GraphForward, GraphBackward, GraphApply, GraphFetch, GraphGrads)


def bundle_reply(tensors: Mapping[str, torch.Tensor], specs: Sequence[EdgeSpec], graph_hash: str,
                 metadata: InferenceReply, call: Call, codec: Codec = NONE) -> Responses:
    return list(edge_messages(tensors, specs, graph_hash, context=metadata.to_bytes(),
                              cls=runtime_pb2.ExpertResponse, seal=call.stream.seal, codec=codec))


class GraphCalls(StreamCalls):
    """Hands a stream's graph requests to ``serving``."""

    def __init__(self, serving: GraphServing, info: StageInfo, *, request_timeout: float,
                 require_encryption: bool) -> None:
        super().__init__(info, request_timeout=request_timeout, require_encryption=require_encryption)
        self.serving = serving

    def handlers(self) -> dict[type, object]:
        return {GraphOpen: self.open, GraphForward: self.forward, GraphBackward: self.backward,
                GraphApply: self.apply, GraphFetch: self.fetch, GraphGrads: self.grads, ParamsPush: self.params}

    async def read_bundle(self, call: Call, specs: Sequence[EdgeSpec]) -> dict[str, torch.Tensor]:
        """The bundle following the request, checked against ``specs`` and this peer's graph hash."""
        plaintext = call.stream.channel is None and self.require_encryption
        async with deadline(self.request_timeout):
            tensors, _ = await read_edge_messages(call.requests, specs, self.serving.graph_hash,
                                                  self.info.max_request_bytes, unseal=call.stream.unseal)
        if plaintext:
            raise RequestError("this peer only takes encrypted streams: send a hello (handshake) first")
        return tensors

    async def open(self, request: GraphOpen, call: Call) -> Responses:
        try:
            self.serving.check_graph(request.arch, request.graph_hash, request.start, request.end)
            step = await self.serving.open(request.run_id, request.optim, call.caller, list(request.shared),
                                           request.checkpoint_every, list(request.replicas), request.average_every,
                                           request.source)
        except (RequestError, ValueError) as e:
            return self._refused(request, call, e)
        return [runtime_pb2.ExpertResponse(metadata=InferenceReply(step=step).to_bytes())]

    async def forward(self, request: GraphForward, call: Call) -> Responses:
        serving = self.serving
        try:
            inputs = await self.read_bundle(call, serving.stage.inputs)
            started = asyncio.get_running_loop().time()
            serving.check_graph(request.arch, request.graph_hash, request.start, request.end)
            codec = edge_codec(request.compression)
            async with deadline(self.request_timeout):
                outputs = await serving.forward(inputs, request.run_id, request.micro_id, call.caller)
        except (RequestError, ValueError, asyncio.TimeoutError) as e:
            return self._refused(request, call, e)
        metadata = InferenceReply(step=serving.run.step if serving.run else 0, compute_ms=_ms(started))
        return bundle_reply(outputs, serving.stage.outputs, serving.graph_hash, metadata, call, codec)

    async def backward(self, request: GraphBackward, call: Call) -> Responses:
        serving = self.serving
        try:
            grads = await self.read_bundle(call, serving.grad_outputs)
            started = asyncio.get_running_loop().time()
            serving.check_hash(request.graph_hash)
            codec = edge_codec(request.compression)
            async with deadline(self.request_timeout):
                out = await serving.backward(grads, request.run_id, request.micro_id, call.caller)
        except (RequestError, ValueError, asyncio.TimeoutError) as e:
            serving.drop(request.run_id, call.caller)  # the step cannot complete: nothing of it is applied
            return self._refused(request, call, e)
        metadata = InferenceReply(step=serving.run.step if serving.run else 0, compute_ms=_ms(started))
        specs = [s for s in serving.grad_inputs if s.name in out]
        if not request.input_grads or not specs:
            return [runtime_pb2.ExpertResponse(metadata=metadata.to_bytes())]
        return bundle_reply(out, specs, serving.graph_hash, metadata, call, codec)

    async def apply(self, request: GraphApply, call: Call) -> Responses:
        try:
            shared = None
            if request.shared:
                try:
                    specs = self.serving.shared_specs(list(request.shared))
                except RequestError:
                    await self.read_bundle(call, ())  # read it whole first: the stream stays in step
                    raise
                shared = await self.read_bundle(call, specs)
            step = await self.serving.apply(request.run_id, request.micro_batches, call.caller, shared)
        except (RequestError, ValueError) as e:
            return self._refused(request, call, e)
        return [runtime_pb2.ExpertResponse(metadata=InferenceReply(step=step).to_bytes())]

    async def params(self, request: ParamsPush, call: Call) -> Responses:
        """A replica's parameters for an averaging round (``peers.server.graph_replicas``)."""
        try:
            flat = await self.read_tensor(call)
            self.serving.receive_params(request, flat, call.caller)
        except (RequestError, ValueError) as e:
            return self._refused(request, call, e)
        return [reply()]

    async def grads(self, request: GraphGrads, call: Call) -> Responses:
        try:
            tensors, specs = self.serving.shared_grads(request.run_id, call.caller)
        except (RequestError, ValueError) as e:
            return self._refused(request, call, e)
        if not specs:
            return [runtime_pb2.ExpertResponse(metadata=InferenceReply().to_bytes())]
        return bundle_reply(tensors, specs, self.serving.graph_hash, InferenceReply(), call)

    async def fetch(self, request: GraphFetch, call: Call) -> Responses:
        try:
            self.serving.check_hash(request.graph_hash)
        except RequestError as e:
            return self._refused(request, call, e)
        tensors, specs = self.serving.state()
        step = self.serving.run.step if self.serving.run else 0
        return bundle_reply(tensors, specs, self.serving.graph_hash, InferenceReply(step=step), call)

    @staticmethod
    def _refused(request: object, call: Call, e: BaseException) -> Responses:
        error = str(e) or "the request exceeded its deadline"
        logger.info("%s from %s refused: %s", type(request).__name__, short_id(call.caller), error)
        return [reply(error=error)]


def _ms(started: float) -> float:
    return max(1e-3, 1e3 * (asyncio.get_running_loop().time() - started))


class GraphStreamHandler(StreamHandler):
    """A peer's stream serving a graph stage: hellos, probes and the graph requests. A graph request refused before
    its handler (not admitted, no hello) has its bundle skipped, so that the stream stays in step. A replica's
    ``ParamsPush`` comes from another peer, not a trainer: its averager checks that it is one of the run's replicas."""

    checked_by_handler = (ParamsPush,)

    def serve_graph(self, calls: GraphCalls) -> None:
        self.handlers.update(calls.handlers())  # type: ignore[arg-type]
        self.graph_calls = calls

    async def skip_tensor(self, call: Call) -> None:
        await super().skip_tensor(call)
        try:
            request = unpack_inference(call.message.metadata)
        except ValueError:
            return
        if isinstance(request, GRAPH_BUNDLE_KINDS) or (isinstance(request, GraphApply) and request.shared):
            try:
                async with deadline(self.request_timeout):
                    await read_edge_messages(call.requests, (), "", self.info.max_request_bytes)
            except (RequestError, ValueError, asyncio.TimeoutError):
                pass
