"""The training requests of a peer's stream: open a run, forward/backward micro-batches, apply a step, and replica
parameters (push for averaging, fetch for a late joiner). A refusal applies nothing."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from hivemind.proto import runtime_pb2

from peers.server.calls import Call, Responses, StreamCalls, elapsed_ms, reply, tensor_reply
from peers.server.training_rpc import TrainingRPC
from peers.wire.errors import RequestError
from peers.wire.messages import (
    InferenceReply,
    ParamsFetch,
    ParamsPush,
    StageInfo,
    TrainApply,
    TrainBackward,
    TrainForward,
    TrainOpen,
)

logger = logging.getLogger(__name__)

TRAINING_KINDS = (TrainOpen, TrainApply, TrainForward, TrainBackward, ParamsPush, ParamsFetch)


class TrainingCalls(StreamCalls):
    """Hands a stream's training requests to ``training`` (the peer's ``TrainingRPC``)."""

    def __init__(self, training: TrainingRPC, info: StageInfo, *, check_hidden: Callable[..., None],
                 request_timeout: float, require_encryption: bool) -> None:
        super().__init__(info, request_timeout=request_timeout, require_encryption=require_encryption)
        self.training, self.check_hidden = training, check_hidden

    async def open(self, request: TrainOpen, call: Call) -> Responses:
        try:
            step = await self.training.open(request, call.stream)
        except (RequestError, ValueError) as e:
            logger.info("train_open(run=%r) refused: %s", request.run_id, e)
            return [reply(error=str(e))]
        return [runtime_pb2.ExpertResponse(metadata=InferenceReply(step=step).to_bytes())]

    async def apply(self, request: TrainApply, call: Call) -> Responses:
        try:
            step = await self.training.apply(request, call.stream)
        except (RequestError, ValueError) as e:
            return [reply(error=str(e))]
        return [runtime_pb2.ExpertResponse(metadata=InferenceReply(step=step).to_bytes())]

    async def fetch(self, request: ParamsFetch, call: Call) -> Responses:
        try:
            flat = self.training.current_params(request)
        except RequestError as e:
            return [reply(error=str(e))]
        return tensor_reply(flat, InferenceReply(step=self.training.step), call.stream)

    async def tensor_call(self, request: TrainForward | TrainBackward | ParamsPush, call: Call) -> Responses:
        """A training forward or backward (or a replica's parameters): one sealed tensor in, one out (or an
        empty reply); a refusal applies nothing."""
        try:
            tensor = await self.read_tensor(call)
            started = time.perf_counter()
            if isinstance(request, ParamsPush):
                self.training.receive_params(request, tensor, call.caller)
                return [reply()]
            if isinstance(request, TrainForward):
                self.check_hidden(tensor)
                output = await self.training.forward(request, tensor, call.stream)
            else:
                if request.recompute and tensor.ndim == 4:
                    self.check_hidden(tensor.flatten(0, 1), max_rows=2 * self.info.max_batch_size)
                else:
                    self.check_hidden(tensor)
                output = await self.training.backward(request, tensor, call.stream)
        except (RequestError, ValueError) as e:  # GradientError is a ValueError
            if isinstance(request, TrainBackward):
                self.training.drop(request, call.stream)  # a refused backward drops its micro-batch
            logger.info("%s(run=%r, %s) refused: %s", type(request).__name__, request.run_id,
                        getattr(request, "micro_id", getattr(request, "round", "")), e)
            return [reply(error=str(e))]
        return tensor_reply(output, InferenceReply(step=self.training.step, compute_ms=elapsed_ms(started)),
                            call.stream)
