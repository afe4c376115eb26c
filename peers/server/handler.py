"""``StageHandler``: each RPC parses, validates, computes and serializes; nothing else."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from hivemind.p2p import P2P, P2PContext
from hivemind.proto import runtime_pb2

from peers.core.finite import all_finite
from peers.server.backend import StageBackend
from peers.server.chain_calls import StreamFor
from peers.server.kv_sessions import SessionRegistry
from peers.server.stream_handler import StreamHandler
from peers.server.training_rpc import TrainingRPC
from peers.wire.errors import MovedError, RequestError, moved_refusal
from peers.wire.messages import InfoRequest, StageInfo
from peers.wire.service import INFERENCE_HANDLE, StageService
from privacy.admission import Admission, caller_key, proof_context
from privacy.identity import Identity
from privacy.peer_ids import short_id

logger = logging.getLogger(__name__)


class StageHandler(StageService):
    """Serves one ``StageBackend`` over hivemind P2P. Bad requests get a reply that says what is wrong."""

    def __init__(
        self, backend: StageBackend | None, info: StageInfo, sessions: SessionRegistry, *, request_timeout: float,
        identity: Identity, require_encryption: bool = True, admission: Admission | None = None,
        training: TrainingRPC | None = None, stream_for: StreamFor | None = None,
    ) -> None:
        self.backend, self.info, self.sessions, self.request_timeout = backend, info, sessions, request_timeout
        self.identity, self.admission = identity, admission or Admission()
        self.inference = StreamHandler(backend, info, sessions, request_timeout=request_timeout,
                                      check_hidden=self._check_hidden, check_blocks=self._check_blocks,
                                      identity=identity, require_encryption=require_encryption,
                                      admission=self.admission, training=training, stream_for=stream_for)
        self.training = training
        self.left: tuple[int, int] | None = None  # the span this peer served before its last move

    def switch(self, backend: StageBackend | None, info: StageInfo, sessions: SessionRegistry,
               training: TrainingRPC | None, *, left: tuple[int, int], unserved: str = "") -> None:
        """Serve ``info``'s span from the next request on (``backend`` None: a backup, which refuses with
        ``unserved``); requests for span ``left`` get a ``moved:`` refusal (``peers.server.stage_server``)."""
        self.backend, self.info, self.sessions, self.training, self.left = backend, info, sessions, training, left
        self.inference.switch(backend, info, sessions, training, unserved)

    async def rpc_info(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertInfo:
        try:
            proof = InfoRequest.from_bytes(request.metadata).proof
            self.admission.admit(proof, proof_context("rpc_info", self.identity.public_bytes),
                                 caller_key(context.remote_id))
        except ValueError as e:  # MembershipError is one
            logger.info("rpc_info(peer=%s) refused: %s", _short(context), e)
            raise RequestError(f"rpc_info refused: {e}") from None
        backend = self.backend
        info = dataclasses.replace(
            self.info, cache_tokens_free=self.sessions.tokens_free, sessions=len(self.sessions.sessions),
            opens_waiting=self.sessions.opens_waiting,
            inference_steps=backend.inference_steps if backend is not None else 0,
            inference_batches=backend.inference_batches if backend is not None else 0,
            train_steps=self.training.step if self.training is not None else 0,
        )
        return runtime_pb2.ExpertInfo(serialized_info=info.to_bytes())

    async def add_p2p_handlers(self, p2p: P2P, wrapper: Any = None, *, namespace: str | None = None,
                               balanced: bool = False) -> None:
        """``rpc_info`` as a hivemind protobuf handler, the stream as our own framed one (``peers.wire.framing``)."""
        await super().add_p2p_handlers(p2p, wrapper, namespace=namespace, balanced=balanced)
        await p2p.add_binary_stream_handler(INFERENCE_HANDLE, self.inference.handle_stream, balanced=balanced)

    async def remove_p2p_handlers(self, p2p: P2P, *, namespace: str | None = None) -> None:
        await p2p.remove_binary_stream_handler(INFERENCE_HANDLE)
        await super().remove_p2p_handlers(p2p, namespace=namespace)

    def _check_blocks(self, start: int, end: int) -> None:
        if not self.info.start <= start < end <= self.info.end:
            if self.left is not None:  # clients with an old view of the swarm: re-route, no ban
                raise MovedError(moved_refusal((self.info.start, self.info.end), self.left))
            raise RequestError(
                f"this peer serves blocks {self.info.start}:{self.info.end}, not {start}:{end}; "
                f"refresh your view of the swarm and route that span elsewhere"
            )

    def _check_hidden(self, hidden: torch.Tensor, max_rows: int | None = None) -> None:
        info, max_rows = self.info, max_rows or self.info.max_batch_size
        if hidden.ndim != 3 or hidden.shape[-1] != info.hidden_size:
            raise RequestError(f"hidden states must be [batch, seq, {info.hidden_size}], got {list(hidden.shape)}")
        if not 1 <= hidden.shape[0] <= max_rows:
            raise RequestError(f"batch of {hidden.shape[0]} is above this peer's limit of {max_rows}")
        if not 1 <= hidden.shape[1] <= info.max_seq_len:
            raise RequestError(f"sequence of {hidden.shape[1]} tokens; this model takes 1..{info.max_seq_len}")
        if not all_finite([hidden]):
            raise RequestError("hidden states contain NaN or infinite values")


def _short(context: P2PContext) -> str:
    return short_id(str(context.remote_id))
