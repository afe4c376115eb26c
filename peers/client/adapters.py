"""Generation with LoRA adapters (issue 19.3): what a client's sessions and forwards name as their ``adapter``.

``ClientConfig.adapter`` is either a run id (the peers' adapter run of that id, trained by this client's identity:
its adapters as they are now) or an exported ``peft`` folder (``swarm export`` of an adapter run, or any plain LoRA
for this model): before a peer first runs a span for us, we load that span's tensors there (``AdapterLoad``, over the
encrypted stream), under a name made from their content. Peers apply an adapter to that session or forward only.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from peers.training.lora import LoraSpec, split_key
from peers.training.lora_files import CONFIG_FILE, read_peft_folder
from peers.wire.errors import RequestError
from peers.wire.messages import AdapterLoad
from peers.wire.stream import PeerStream


class ClientAdapter:
    """The adapter of a client's requests: ``name`` as the peers know it; ``spec`` and ``state`` for a folder."""

    def __init__(self, text: str) -> None:
        self.spec: LoraSpec | None = None
        self.state: dict[str, torch.Tensor] = {}
        self.name = text
        self._loaded: dict[tuple[int, int, int], PeerStream] = {}  # (id(stream), start, end) -> the stream
        if text and (Path(text) / CONFIG_FILE).is_file():
            self.spec, self.state = read_peft_folder(text)
            digest = hashlib.sha256(self.spec.text().encode())
            for key in sorted(self.state):
                digest.update(key.encode() + self.state[key].float().numpy().tobytes())
            self.name = "file:" + digest.hexdigest()[:24]
        elif text and Path(text).is_dir():
            raise ValueError(f"{text} has no {CONFIG_FILE}: pass an exported adapter folder (swarm export of an "
                             "adapter run) or the run id of your adapter run")

    async def name_for(self, stream: PeerStream, start: int, end: int, timeout: float) -> str:
        """The adapter name for blocks ``[start, end)`` on ``stream``'s peer, loading a folder's tensors first."""
        if self.spec is None or (id(stream), start, end) in self._loaded:
            return self.name
        names = sorted(k for k in self.state if start <= split_key(k.partition(".")[2])[0] < end)
        flat = torch.cat([self.state[n].reshape(-1).float() for n in names]) if names else torch.zeros(0)
        reply, _ = await stream.call(AdapterLoad(name=self.name, spec=self.spec.text(), start=start, end=end,
                                                 names=names), flat, timeout)
        if reply.error:  # (call raises on a refusal; kept for a reply that carries one anyway)
            raise RequestError(reply.error)
        self._loaded[id(stream), start, end] = stream
        return self.name
