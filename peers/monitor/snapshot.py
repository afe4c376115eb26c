"""The monitor's data: one JSON-ready dict per model, made from the records and plans ``swarm status`` reads. Pure.

It carries what records carry (spans, states, compute, links, cache use, versions) and nothing secret: no addresses,
keys or certificates, so a monitor opened to others shows no more than ``swarm status`` prints.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from swarm.block_selection import missing_blocks
from swarm.plan.route import live
from swarm.plan.types import Plan
from swarm.records import PeerRecord, PeerState

SHOWN_LINKS = 3  # best links per peer, as in ``swarm status``


class OnlineSince:
    """When this monitor first saw each peer ONLINE, without a gap since (its own view: records carry no start time)."""

    def __init__(self) -> None:
        self._since: dict[str, float] = {}

    def update(self, records: Sequence[PeerRecord], now: float) -> dict[str, float]:
        online = {r.peer_id for r in records if r.state == PeerState.ONLINE}
        self._since = {p: self._since.get(p, now) for p in online}
        return dict(self._since)


def coverage(records: Sequence[PeerRecord], num_blocks: int) -> list[int]:
    """How many ONLINE peers serve each block."""
    counts = [0] * num_blocks
    for r in records:
        if r.state == PeerState.ONLINE:
            for block in range(r.start, min(r.end, num_blocks)):
                counts[block] += 1
    return counts


def swarm_tokens_per_s(records: Sequence[PeerRecord], num_blocks: int) -> float:
    """Tokens/s the swarm's compute carries through every block: per block, the sum over its ONLINE peers of the
    tokens/s each gives it (a peer's time is split over its span), then the weakest block's (0 if one is missing).
    Compute only: links and batching are not counted, so this is an upper bound."""
    per_block = [0.0] * num_blocks
    for r in records:
        if r.state == PeerState.ONLINE:
            for block in range(r.start, min(r.end, num_blocks)):
                per_block[block] += 1.0 / (r.seconds_per_block * r.num_blocks)
    return min(per_block, default=0.0)


def ranges(blocks: Sequence[int]) -> list[list[int]]:
    """[0, 1, 2, 5] -> [[0, 3], [5, 6]]: runs of consecutive blocks as [start, end)."""
    spans: list[list[int]] = []
    for b in blocks:
        if spans and spans[-1][1] == b:
            spans[-1][1] = b + 1
        else:
            spans.append([b, b + 1])
    return spans


def peer_view(r: PeerRecord, since: float | None) -> dict[str, Any]:
    links = sorted(r.links, key=lambda row: (-row.bandwidth, row.rtt))[:SHOWN_LINKS]
    return {
        "peer_id": r.peer_id, "name": r.public_name, "state": r.state.value,
        "start": r.start, "end": r.end, "serves": r.state != PeerState.BACKUP,  # a backup's span is what it could take
        "tokens_per_s_per_block": round(r.throughput, 3),
        "forward_ms": round(r.forward_seconds * 1e3, 4), "backward_ms": round(r.backward_seconds * 1e3, 4),
        "links": [{"peer_id": row.peer_id, "mbit_s": round(row.bandwidth / 1e6, 3), "rtt_ms": round(row.rtt * 1e3, 3),
                   "source": row.source} for row in links],
        "cache": {"tokens": r.cache_tokens, "used": r.cache_used} if r.cache_tokens else None,
        "version": r.version, "device": r.device, "dtype": r.dtype, "online_since": since,
    }


def plan_view(plan: Plan, records: Sequence[PeerRecord]) -> dict[str, Any]:
    return {
        "version": plan.version, "broker": plan.broker, "run_id": plan.run_id, "objective": plan.objective,
        "groups": [{"stages": [{"peer_id": s.peer_id, "start": s.start, "end": s.end} for s in g.stages],
                    "tokens_per_s": round(g.tokens_per_s, 3), "live": live(g, records)} for g in plan.groups],
        "backups": list(plan.backups),
    }


def model_view(model: str, records: Sequence[PeerRecord], plans: Sequence[Plan], num_blocks: int, *,
               since: dict[str, float], sealed: int = 0, error: str = "") -> dict[str, Any]:
    """Everything the monitor shows of one model (``num_blocks`` 0: unknown, the records' furthest block)."""
    num_blocks = num_blocks or max((r.end for r in records if r.state != PeerState.BACKUP), default=0)
    missing = missing_blocks(records, num_blocks)
    ordered = sorted(records, key=lambda r: (r.state == PeerState.BACKUP, r.start, r.end, r.peer_id))
    return {
        "model": model, "num_blocks": num_blocks, "coverage": coverage(records, num_blocks),
        "missing": ranges(missing),
        "peers": [peer_view(r, since.get(r.peer_id)) for r in ordered],
        "online": sum(r.state == PeerState.ONLINE for r in records),
        "backups": [r.peer_id for r in records if r.state == PeerState.BACKUP],
        "tokens_per_s": round(swarm_tokens_per_s(records, num_blocks), 3),
        "plans": [plan_view(p, records) for p in plans],
        "sealed": sealed, "error": error,
    }


def access_note(private: bool, sealed: int) -> str:
    """What this monitor can see: said on the page and in the JSON."""
    if private:
        return "private swarm: showing what these credentials can read"
    if sealed:
        return (f"private swarm: {sealed} record(s) are sealed for its members; start the monitor with --private "
                f"CREDENTIALS --identity_path ID to read them")
    return "public swarm"


def swarm_state(models: Sequence[dict[str, Any]], *, private: bool, refresh: float,
                now: float | None = None) -> dict[str, Any]:
    """The whole JSON document of ``/api/state``."""
    return {
        "generated_at": time.time() if now is None else now, "refresh_s": refresh,
        "access": access_note(private, sum(m["sealed"] for m in models)), "models": list(models),
    }
