"""Loading a span a peer moves to: blocks it lacks from the model folder, blocks it keeps from its old span, and
the trained weights other peers hold now (``ParamsFetch`` of a sub-range of their span)."""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from peers.model import StageBlocks, load_blocks
from peers.server.training_rpc import fetch_params
from privacy.peer_ids import short_id
from swarm.discovery import fetch_records
from swarm.records import PeerState

logger = logging.getLogger(__name__)


def load_new_blocks(model_dir: Path, start: int, end: int, have: range, *, device: torch.device,
                    dtype: torch.dtype) -> dict[int, torch.nn.Module]:
    """Blocks of ``[start, end)`` not in ``have`` (the old span), from the model folder (call it on a thread)."""
    fresh: dict[int, torch.nn.Module] = {}
    for first, last in runs(i for i in range(start, end) if i not in have):
        loaded = load_blocks(model_dir, first, last, device=device, dtype=dtype)
        fresh.update({first + k: block for k, block in enumerate(loaded)})
    return fresh


def assemble(fresh: dict[int, torch.nn.Module], start: int, end: int, old_blocks: Sequence[torch.nn.Module],
             old_start: int, *, copy_kept: bool) -> StageBlocks:
    """The new span's blocks: the old span's where they overlap (copies with ``copy_kept``, when training may change
    them: the old span serves its own until it is freed), the fresh ones elsewhere."""
    blocks = []
    for i in range(start, end):
        if i in fresh:
            blocks.append(fresh[i])
        else:
            kept = old_blocks[i - old_start]
            blocks.append(copy.deepcopy(kept) if copy_kept else kept)
    return StageBlocks(blocks, start, end).eval()


async def fetch_trained(fresh: dict[int, torch.nn.Module], *, node: Any, model_name: str, peer_id: str,
                        stream_for: Callable[[str], Awaitable[Any]], dht_timeout: float,
                        request_timeout: float) -> int:
    """The fresh blocks take the parameters the peers serving them hold now, so that trained weights move with the
    blocks; a block nobody serves (or whose peer fails) keeps the model folder's. Returns the highest step fetched
    (0: none)."""
    try:
        records = await asyncio.wait_for(fetch_records(node, model_name), dht_timeout)
    except Exception as e:
        logger.warning("Could not look for peers serving blocks %s (%r): the new blocks start from the model folder",
                       _spans(fresh), e)
        return 0
    serving = [r for r in records if r.state == PeerState.ONLINE and r.peer_id != peer_id]
    best = 0
    for first, last in runs(fresh):
        position = first
        while position < last:
            source = max((r for r in serving if r.start <= position < r.end), key=lambda r: r.end, default=None)
            if source is None:
                logger.info("No peer serves block %d now: it starts from the model folder", position)
                position += 1
                continue
            stop = min(last, source.end)
            try:
                step, flat = await fetch_params(stream_for, source.peer_id, position, stop, request_timeout)
                load_flat([fresh[i] for i in range(position, stop)], flat)
            except Exception as e:
                logger.warning("Could not fetch blocks %d:%d from peer %s (%s): they start from the model folder",
                               position, stop, short_id(source.peer_id), e)
            else:
                best = max(best, step)
                logger.info("Fetched the current parameters of blocks %d:%d from peer %s (%d:%d, step %d)",
                            position, stop, short_id(source.peer_id), source.start, source.end, step)
            position = stop
    return best


def has_checkpoint(directory: Path | str | None, start: int, end: int) -> bool:
    """Whether a training checkpoint of exactly blocks ``[start, end)`` is in ``directory`` (any run)."""
    return directory is not None and any(Path(directory).glob(f"*/blocks-{start}-{end}/state.json"))


def runs(indices: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted block indices as maximal contiguous ``[first, last)`` runs."""
    found: list[tuple[int, int]] = []
    for i in sorted(indices):
        if found and found[-1][1] == i:
            found[-1] = (found[-1][0], i + 1)
        else:
            found.append((i, i + 1))
    return found


def load_flat(blocks: list[torch.nn.Module], flat: torch.Tensor) -> None:
    """Load a peer's flat parameters of these blocks (checked: size, finite)."""
    params = [p for block in blocks for p in block.parameters()]
    numel = sum(p.numel() for p in params)
    if flat.ndim != 1 or flat.numel() != numel or not bool(torch.isfinite(flat).all()):
        raise ValueError(f"got {list(flat.shape)} values; expected {numel} finite ones")
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(flat.to(params[0].dtype), params)


def _spans(fresh: dict[int, torch.nn.Module]) -> str:
    return ", ".join(f"{a}:{b}" for a, b in runs(fresh))
