"""The training requests of a peer's stream: open a run, forward/backward micro-batches, apply a step, and replica
parameters (push for averaging, fetch for a late joiner); in a chain (``peers.server.training_chain``), pushes from
the adjacent stages and deferred forwards/backwards that wait for them. A refusal applies nothing."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from hivemind.proto import runtime_pb2

from peers.server.calls import Call, Deferred, Responses, StreamCalls, defer, elapsed_ms, reply, tensor_reply
from peers.server.training_rpc import TrainingRPC, frozen_base
from peers.training.prompts import prompt_rows
from peers.wire.errors import ChainError, RequestError
from peers.wire.messages import (
    InferenceReply,
    ParamsFetch,
    ParamsPush,
    StageInfo,
    TrainApply,
    TrainBackward,
    TrainFetch,
    TrainForward,
    TrainOpen,
    TrainPush,
)
from privacy.peer_ids import short_id

logger = logging.getLogger(__name__)

TRAINING_KINDS = (TrainOpen, TrainApply, TrainForward, TrainBackward, ParamsPush, ParamsFetch, TrainPush, TrainFetch)


class TrainingCalls(StreamCalls):
    """Hands a stream's training requests to ``training`` (the peer's ``TrainingRPC``)."""

    def __init__(self, training: TrainingRPC, info: StageInfo, *, check_hidden: Callable[..., None],
                 request_timeout: float, require_encryption: bool) -> None:
        super().__init__(info, request_timeout=request_timeout, require_encryption=require_encryption)
        self.training, self.check_hidden = training, check_hidden

    def _rpc(self, run_id: str) -> TrainingRPC:
        """The side that serves run ``run_id``: its adapter run's (``peers.server.adapter_runs``), else the base."""
        runs = self.training.adapter_runs
        return (runs.get(run_id) if runs is not None else None) or self.training

    async def open(self, request: TrainOpen, call: Call) -> Responses:
        try:
            runs = self.training.adapter_runs
            if frozen_base(request) and runs is not None:
                step = await runs.open(request, call.stream, call.caller)
            elif runs is not None and runs.get(request.run_id) is not None:
                raise RequestError(f"run {request.run_id[:64]!r} trains adapters here: open it with its adapter spec")
            else:
                step = await self.training.open(request, call.stream)
        except (RequestError, ValueError) as e:
            logger.info("train_open(run=%r) refused: %s", request.run_id, e)
            return [reply(error=str(e))]
        return [runtime_pb2.ExpertResponse(metadata=InferenceReply(step=step).to_bytes())]

    async def apply(self, request: TrainApply, call: Call) -> Responses:
        try:
            step = await self._rpc(request.run_id).apply(request, call.stream)
        except (RequestError, ValueError) as e:
            return [reply(error=str(e))]
        return [runtime_pb2.ExpertResponse(metadata=InferenceReply(step=step).to_bytes())]

    async def fetch(self, request: ParamsFetch, call: Call) -> Responses:
        rpc = self._rpc(request.run_id)
        try:
            flat = rpc.current_params(request)
        except RequestError as e:
            return [reply(error=str(e))]
        return tensor_reply(flat, InferenceReply(step=rpc.step), call.stream)

    async def tensor_call(self, request: TrainForward | TrainBackward | ParamsPush, call: Call
                          ) -> Responses | Deferred:
        """A training forward or backward (or a replica's parameters): one sealed tensor in, one out (or an
        empty reply); a refusal applies nothing. One naming a peer neighbour is chained (``chained``)."""
        if isinstance(request, (TrainForward, TrainBackward)) and (request.upstream or request.downstream):
            return await self.chained(request, call)
        rpc = self._rpc(request.run_id)
        try:
            tensor = await self.read_tensor(call)
            started = time.perf_counter()
            if isinstance(request, ParamsPush):
                rpc.receive_params(request, tensor, call.caller)
                return [reply()]
            if isinstance(request, TrainForward):  # (deep prompts' rows come after the batch's: not batch rows)
                extra = prompt_rows(request.prompt_shape, tensor.shape[1]) if tensor.ndim == 3 else 0
                self.check_hidden(tensor, max_rows=self.info.max_batch_size + extra)
                output = await rpc.forward(request, tensor, call.stream)
            else:
                if request.recompute and tensor.ndim == 4:
                    self.check_hidden(tensor.flatten(0, 1), max_rows=2 * self.info.max_batch_size)
                else:
                    self.check_hidden(tensor)
                output = await rpc.backward(request, tensor, call.stream)
        except (RequestError, ValueError) as e:  # GradientError is a ValueError
            if isinstance(request, TrainBackward):
                rpc.drop(request, call.stream)  # a refused backward drops its micro-batch
            logger.info("%s(run=%r, %s) refused: %s", type(request).__name__, request.run_id,
                        getattr(request, "micro_id", getattr(request, "round", "")), e)
            return [reply(error=str(e))]
        step = rpc.step_of(request.run_id, call.stream)  # (a prompt run's own count)
        return tensor_reply(output, InferenceReply(step=step, compute_ms=elapsed_ms(started)), call.stream)

    async def push(self, request: TrainPush, call: Call) -> Responses:
        """An adjacent stage's output (or grad) for a micro-batch of our run: into the inbox, acked at once."""
        try:
            tensor, indices = await self.read_coded(call)
            started = time.perf_counter()
            self.check_hidden(tensor)
            self._rpc(request.run_id).receive_push(request, tensor, call.caller, indices)
        except (RequestError, ValueError) as e:
            logger.info("train_push(run=%r, %s) from %s refused: %s", request.run_id, request.micro_id[:64],
                        short_id(call.caller), e)
            return [reply(error=str(e))]
        # the ack reports our time: the pusher's stream measures the link between the two peers (``swarm.links``)
        return [runtime_pb2.ExpertResponse(metadata=InferenceReply(compute_ms=elapsed_ms(started)).to_bytes())]

    async def fetch_kept(self, request: TrainFetch, call: Call) -> Responses:
        rpc = self._rpc(request.run_id)
        try:
            tensor = rpc.kept(request, call.stream)
        except RequestError as e:
            return [reply(error=str(e))]
        return tensor_reply(tensor, InferenceReply(step=rpc.step), call.stream)

    async def chained(self, request: TrainForward | TrainBackward, call: Call) -> Responses | Deferred:
        """A forward or backward whose input comes from a peer (no tensor here: deferred until its push) or whose
        result goes to one (pushed there, the reply carries none)."""
        backward = isinstance(request, TrainBackward)
        rpc = self._rpc(request.run_id)
        try:
            rpc.check_chained(request, call.stream)
            if request.upstream:
                if call.message.tensors:
                    await self.skip_tensor(call)
                    raise RequestError("a chained request whose input comes from a peer carries no tensor")
                tensor = indices = None
            else:
                tensor, indices = await self.read_coded(call)
                self.check_hidden(tensor)
        except (RequestError, ValueError) as e:
            if backward:
                rpc.drop(request, call.stream)
            logger.info("chained %s(run=%r, %s) refused: %s", type(request).__name__, request.run_id,
                        request.micro_id[:64], e)
            return [reply(error=str(e))]
        return defer(self._chained(request, tensor, indices, call), f"chained {type(request).__name__}")

    async def _chained(self, request: TrainForward | TrainBackward, tensor: torch.Tensor | None,
                       indices: torch.Tensor | None, call: Call) -> Responses:
        rpc = self._rpc(request.run_id)
        try:
            output, compute_ms = await rpc.chain.run(request, tensor, call.stream, indices, call.caller)
        except ChainError as e:  # our result could not reach the next peer: that peer failed, not us
            logger.info("%s(run=%r, %s): %s", type(request).__name__, request.run_id, request.micro_id[:64], e)
            failed = InferenceReply(error=str(e), failed_peer=e.failed_peer, step=rpc.step)
            return [runtime_pb2.ExpertResponse(metadata=failed.to_bytes())]
        except (RequestError, ValueError) as e:  # GradientError is a ValueError
            if isinstance(request, TrainBackward):
                rpc.drop(request, call.stream)
            logger.info("%s(run=%r, %s) refused: %s", type(request).__name__, request.run_id, request.micro_id[:64], e)
            return [reply(error=str(e))]
        metadata = InferenceReply(step=rpc.step, compute_ms=compute_ms)
        if output is None:
            return [runtime_pb2.ExpertResponse(metadata=metadata.to_bytes())]
        return tensor_reply(output, metadata, call.stream)
