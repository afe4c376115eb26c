"""What crosses a client's (or trainer's) link: frame bytes of its streams, and the hidden-state payload in them.

``LinkMeter(client)`` sums ``bytes_sent + bytes_received`` of the client's streams (``PeerStream``: every frame,
headers, metadata, sealing and heartbeats included) and, while it is entered, counts the plaintext tensor bytes
those streams send and receive (hidden states, gradients) by wrapping the two functions ``peers.wire.stream`` uses
to (de)serialize tensors (dense, before a codec compresses them). Only this process's streams are counted: the peers
run in other processes, so what they push to each other never shows here. ``reading()`` is a snapshot; subtract two
of them.
A stream that was dropped (its peer died) leaves the client's table and its bytes with it: read around runs in which
no peer fails.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

import peers.wire.stream as stream_module
from peers.client.swarm_client import SwarmClient

FLOAT32 = 4


@dataclass(frozen=True)
class Reading:
    frame_bytes: int  # both directions, every frame of the client's streams
    payload_bytes: int  # plaintext tensor bytes in them (hidden states, gradients), both directions

    def __sub__(self, other: Reading) -> Reading:
        return Reading(self.frame_bytes - other.frame_bytes, self.payload_bytes - other.payload_bytes)

    def per(self, count: float, hidden_size: int) -> dict:
        """Bytes per ``count`` (a token), also in hidden states (``hidden_size`` fp32 values) and split into the
        tensor payload and the rest (framing, protobuf, message metadata, AES-GCM tags, heartbeats)."""
        state = hidden_size * FLOAT32
        total, payload = self.frame_bytes / count, self.payload_bytes / count
        return {"bytes": round(total, 1), "hidden_states": round(total / state, 3),
                "payload_bytes": round(payload, 1), "payload_hidden_states": round(payload / state, 3),
                "other_bytes": round(total - payload, 1)}


class LinkMeter:
    """Counts what the client's streams carry; enter it (once) before the client sends anything to be counted."""

    def __init__(self, client: SwarmClient | None = None) -> None:
        self.clients: list[SwarmClient] = [client] if client is not None else []
        self.payload = 0
        self._stack = contextlib.ExitStack()

    def streams(self, client: SwarmClient) -> list[Any]:
        return list(client._links._streams.values())

    def reading(self, client: SwarmClient | None = None) -> Reading:
        """Frame bytes of ``client``'s streams (all clients given at construction if None), and the payload so far
        (of every stream in this process)."""
        clients = [client] if client is not None else self.clients
        frames = sum(s.bytes_sent + s.bytes_received for c in clients for s in self.streams(c))
        return Reading(frames, self.payload)

    def __enter__(self) -> LinkMeter:
        original_write, original_read = stream_module.tensor_messages, stream_module.read_coded_messages

        def tensor_messages(tensor: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
            dense = tensor if isinstance(tensor, torch.Tensor) else None  # an ``Encoded`` one: its buffer
            self.payload += dense.numel() * dense.element_size() if dense is not None else len(
                tensor.serialized.buffer)
            return original_write(tensor, *args, **kwargs)

        async def read_coded_messages(*args: Any, **kwargs: Any) -> tuple[bytes, Any, Any]:
            metadata, tensor, indices = await original_read(*args, **kwargs)
            self.payload += tensor.numel() * tensor.element_size()
            return metadata, tensor, indices

        stream_module.tensor_messages = tensor_messages  # type: ignore[assignment]
        stream_module.read_coded_messages = read_coded_messages  # type: ignore[assignment]

        def restore() -> None:
            stream_module.tensor_messages = original_write  # type: ignore[assignment]
            stream_module.read_coded_messages = original_read  # type: ignore[assignment]

        self._stack.callback(restore)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
