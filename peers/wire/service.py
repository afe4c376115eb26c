"""The service of a stage peer: its unary RPC (``rpc_info``), the handle of its stream, and heartbeats."""

from __future__ import annotations

from hivemind.p2p import P2PContext, ServicerBase
from hivemind.proto import runtime_pb2

from peers.wire.messages import InferenceReply

HEARTBEAT_METADATA = InferenceReply(alive=True).to_bytes()  # a heartbeat frame's metadata (and no tensor)
HEARTBEAT_PERIOD = 1.0  # seconds between a peer's heartbeats on a stream whose requests it is working on
INFERENCE_HANDLE = "fusionswarm.StageService.rpc_inference"  # the stream's handle (framed by peers.wire.framing)


class StageService(ServicerBase):
    """The unary RPCs of a stage peer. Handle names are fixed so that any subclass serves the same protocol.

    The long-lived stream (``INFERENCE_HANDLE``) that carries every tensor between a client and the peer is not a
    hivemind protobuf handler: ``peers.wire.framing`` reads it with a size cap and a deadline-safe queue. It carries
    a hello (handshake + admission), then forwards, inference sessions (open, steps, close) and training calls.
    """

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        name = f"fusionswarm.StageService.{method_name}"
        return name if namespace is None else f"{namespace}::{name}"

    async def rpc_info(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertInfo:
        """``request.metadata`` is an ``InfoRequest``; the reply's ``serialized_info`` a ``StageInfo``."""
        raise NotImplementedError


