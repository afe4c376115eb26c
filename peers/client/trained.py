"""The weights a training run left on the swarm's peers: each block's current parameters, fetched over this client's
encrypted streams (``ParamsFetch`` naming the run, open to every admitted peer, read-only)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from peers.wire.messages import ParamsFetch
from privacy.peer_ids import short_id
from swarm.records import PeerRecord, PeerState

if TYPE_CHECKING:
    from peers.client.swarm_client import SwarmClient

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FetchedBlock:
    index: int
    step: int  # the run's optimizer step of these weights, on that peer
    peer_id: str
    flat: torch.Tensor  # parameters_to_vector of the block's parameters


def fetch_run_blocks(client: SwarmClient, run_id: str, step: int | None = None) -> list[FetchedBlock]:
    """Every block of the model as the online peers serving it hold it for run ``run_id``, one block per call (small
    messages). With ``step``, a block must be at that step (a replica that is not is skipped for another one).

    ``ValueError`` naming each block no peer could give, and why."""
    records = [r for r in client.records() if r.state == PeerState.ONLINE]
    return client.loop.run(_fetch_all(client, records, run_id, step))


async def _fetch_all(client: SwarmClient, records: list[PeerRecord], run_id: str,
                     step: int | None) -> list[FetchedBlock]:
    found: list[FetchedBlock] = []
    problems: list[str] = []
    for index in range(client.model_config.num_layers):
        holders = sorted((r for r in records if r.start <= index < r.end), key=lambda r: r.peer_id)
        reasons = []
        for record in holders:
            try:
                stream = await client.peer_stream(record.peer_id)
                reply, flat = await stream.call(ParamsFetch(start=index, end=index + 1, run_id=run_id), None,
                                                client.config.request_timeout)
            except Exception as e:  # refused (another run's weights), unreachable, ...
                reasons.append(f"{short_id(record.peer_id)}: {e}")
                continue
            if step is not None and reply.step != step:
                reasons.append(f"{short_id(record.peer_id)} holds step {reply.step}, not {step}")
                continue
            if flat is None:
                reasons.append(f"{short_id(record.peer_id)} sent no tensor")
                continue
            found.append(FetchedBlock(index, reply.step, record.peer_id, flat))
            logger.debug("block %d of run %r: step %d from %s", index, run_id, reply.step, short_id(record.peer_id))
            break
        else:
            problems.append(f"block {index}: " + ("; ".join(reasons) if reasons else "no online peer serves it"))
    if problems:
        raise ValueError(f"could not fetch every block of run {run_id!r} from the swarm: " + " | ".join(problems))
    return found
