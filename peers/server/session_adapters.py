"""Adapters for inference (issue 19.3): what a session or a forward that names an ``adapter`` runs with, on this peer.

A name is either the run id of the caller's own adapter run here (its adapters as they are now, ``AdapterRuns``),
or the name of adapters the caller loaded here (``AdapterLoad``: an exported ``peft`` folder's tensors for some of
our blocks). Either way the adapter is active only in the calls of that session or forward
(``peers.model.adapters``): the shared blocks and every other client's results stay as they are. Loaded adapters
belong to the caller that loaded them; at most ``max_loaded`` are kept (the least recently used goes first).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from peers.core.finite import all_finite
from peers.model.adapters import Active
from peers.model.blocks import StageBlocks
from peers.training.lora import LoraAdapter, parse_adapter
from peers.wire.errors import RequestError
from peers.wire.messages import AdapterLoad

MAX_LOADED = 16


class SessionAdapters:
    """Adapters loaded by callers for blocks of ``blocks``; ``run_adapter(caller, run_id)`` gives an adapter run's."""

    def __init__(self, blocks: StageBlocks, run_adapter: Callable[[str, str], Active | None], *,
                 max_loaded: int = MAX_LOADED) -> None:
        self.blocks, self.run_adapter, self.max_loaded = blocks, run_adapter, max_loaded
        # (caller, name, start, end) -> (its active map, last use)
        self.loaded: dict[tuple[str, str, int, int], tuple[Active, float]] = {}

    def load(self, caller: str, request: AdapterLoad, flat: torch.Tensor | None) -> None:
        """Check and keep ``caller``'s adapters ``request.name`` for blocks ``[start, end)`` (``RequestError``)."""
        first, last = self.blocks.start, self.blocks.end
        if not first <= request.start < request.end <= last:
            raise RequestError(f"this peer serves blocks {first}:{last}, not {request.start}:{request.end}")
        if not request.name or len(request.name) > 256:
            raise RequestError("an adapter needs a name of 1..256 characters")
        try:
            spec = parse_adapter(request.spec)
            if spec is None:
                raise ValueError("an adapter load needs a LoRA spec")
            adapter = LoraAdapter(self.blocks[request.start - first:request.end - first], spec, 0)
        except ValueError as e:
            raise RequestError(str(e)) from None
        state = adapter.state_dict()
        names = sorted(state)
        if list(request.names) != names:
            raise RequestError(f"these adapters do not fit blocks {request.start}:{request.end} with {spec.text()}: "
                               f"expected {len(names)} tensors ({names[:3]}...), got {len(request.names)} "
                               f"({list(request.names)[:3]}...)")
        numel = sum(state[n].numel() for n in names)
        if flat is None or flat.ndim != 1 or flat.numel() != numel or not all_finite([flat]):
            raise RequestError(f"adapter {request.name[:64]!r} needs {numel} finite values for blocks "
                               f"{request.start}:{request.end}, got {None if flat is None else list(flat.shape)}")
        with torch.no_grad():
            for name, chunk in zip(names, flat.split([state[n].numel() for n in names]), strict=True):
                state[name].copy_(chunk.view_as(state[name]))
        adapter.requires_grad_(False)
        key = (caller, request.name, request.start, request.end)
        if key not in self.loaded and len(self.loaded) >= self.max_loaded:
            del self.loaded[min(self.loaded, key=lambda k: self.loaded[k][1])]
        self.loaded[key] = (adapter.deltas(), time.monotonic())

    def resolve(self, caller: str, name: str, start: int, end: int) -> Active | None:
        """What ``caller``'s request on blocks ``[start, end)`` naming ``name`` runs with (None for ``""``)."""
        if not name:
            return None
        for (owner, loaded, first, last), (active, _) in self.loaded.items():
            if owner == caller and loaded == name and first <= start and end <= last:
                self.loaded[owner, loaded, first, last] = (active, time.monotonic())
                return active
        active = self.run_adapter(caller, name)
        if active is None:
            raise RequestError(f"no adapter {name[:64]!r} of yours for blocks {start}:{end} here: name your adapter "
                               "run's id (as its trainer), or load exported adapters first (swarm generate --adapter "
                               "FOLDER does)")
        return active
