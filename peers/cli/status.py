"""The swarm status table: who is online, which blocks they serve, how fast, and what is missing."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from peers.core.config import SwarmConfig
from peers.model.hub import HUB_ID, resolve_model
from swarm.block_selection import missing_blocks
from swarm.discovery import SwarmNode, start_node
from swarm.plan.route import live
from swarm.plan.types import Group, Plan
from swarm.records import PeerRecord, PeerState


def model_name_and_blocks(model: str, model_name: str | None = None) -> tuple[str, int]:
    """The swarm name of ``model`` (a folder, a cached hub id or a name in the swarm) and its number of blocks (0:
    unknown here, a name with no folder); ``model_name`` overrides the name."""
    name, total = model, 0
    try:
        model_path: Path | None = resolve_model(model)
    except ValueError:
        model_path = None  # a name in the swarm (with no folder here)
    if model_path is not None and (model_path / "config.json").is_file():
        from peers.model import ModelConfig

        config = ModelConfig.from_dir(model_path)
        name, total = config.name, config.num_layers
    elif HUB_ID.fullmatch(model) and not model_name:
        resolve_model(model)  # raises: not cached, saying how to get it (or pass the swarm's name)
    return model_name or name, total


async def start_reader(swarm: SwarmConfig) -> SwarmNode:
    """A DHT client that reads the swarm with this config's credentials (a private swarm's records, if a member)."""
    from peers.core.access import load_admission, load_identity

    identity = load_identity(swarm)
    admission = load_admission(swarm, identity)
    return await start_node(initial_peers=swarm.initial_peers, host_maddrs=swarm.host_maddrs, client_mode=True,
                            identity=identity, record_validator=admission.record_validator(), nat=swarm.nat())


_STATE_STYLE = {
    PeerState.ONLINE: "green",
    PeerState.JOINING: "yellow",
    PeerState.BACKUP: "cyan",
    PeerState.OFFLINE: "dim",
}


def blocks_cell(record: PeerRecord) -> str:
    """The span a peer serves; a backup serves none (its record's span ``0:N`` is how many it could take)."""
    return f"none (up to {record.num_blocks})" if record.state == PeerState.BACKUP else record.span


SHOWN_LINKS = 3  # best links shown per peer (a record carries up to 8)


def status_table(model: str, records: list[PeerRecord], total_blocks: int) -> Table:
    table = Table(title=f"fusionswarm: {model} ({total_blocks} blocks, {len(records)} peers)")
    for column in ("peer", "name", "blocks", "state", "tokens/s per block", "fwd/bwd ms per token per block",
                   "best links", "device", "dtype", "version"):
        table.add_column(column, justify="right" if column.startswith(("tokens", "fwd")) else "left")
    for r in sorted(records, key=lambda r: (r.start, r.end, r.peer_id)):
        style = _STATE_STYLE[r.state]
        table.add_row(
            f"...{r.peer_id[-8:]}", r.public_name or "-", blocks_cell(r), f"[{style}]{r.state.value}[/{style}]",
            f"{r.throughput:,.0f}", compute_cell(r), links_cell(r), r.device, r.dtype, r.version or "-",
        )
    missing = missing_blocks(records, total_blocks)
    table.caption = (
        f"[red]missing blocks: {_ranges(missing)}[/red] — start a peer with --block_indices for them"
        if missing
        else "[green]every block is served[/green]"
    )
    return table


def compute_cell(record: PeerRecord) -> str:
    """``0.012 / 0.031``: measured forward / backward ms per token per block ("-" for a figure not measured)."""
    if record.forward_seconds <= 0 and record.backward_seconds <= 0:
        return "-"
    return f"{_ms(record.forward_seconds)} / {_ms(record.backward_seconds)}"


def links_cell(record: PeerRecord, limit: int = SHOWN_LINKS) -> str:
    """``...abcd 95 Mbit/s 1.2 ms`` per best link (fastest first), one per line; "-" if none is known."""
    rows = sorted(record.links, key=lambda row: (-row.bandwidth, row.rtt))[:limit]
    if not rows:
        return "-"
    return "\n".join(f"...{row.peer_id[-4:]} {_rate(row.bandwidth)} {row.rtt * 1e3:.1f} ms" for row in rows)


def _ms(seconds: float) -> str:
    return "-" if seconds <= 0 else f"{seconds * 1e3:.3g}"


def _rate(bits_per_second: float) -> str:
    """``95 Mbit/s``, ``1.2 Gbit/s``; ``? Mbit/s`` where only the round trip is known."""
    if bits_per_second <= 0:
        return "? Mbit/s"
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:.3g} {unit}"
    return f"{bits_per_second:.0f} bit/s"


def plans_table(plans: list[Plan], records: list[PeerRecord]) -> Table:
    """One row per group of each plan found: the plan (version, broker, run), the group's stages in pipeline order,
    its estimated tokens/s, whether its peers serve it now, and the plan's backups."""
    table = Table(title=f"plans ({len(plans)})")
    for column in ("plan", "broker", "run", "group", "stages", "est. tokens/s", "serving", "backups"):
        table.add_column(column, justify="right" if column.startswith("est") else "left")
    for plan in sorted(plans, key=lambda p: (p.run_id, p.broker)):
        backups = " ".join(_short(b) for b in plan.backups) or "-"
        rows: list[tuple[int | None, Group | None]] = list(enumerate(plan.groups)) or [(None, None)]
        for i, group in rows:
            first = i in (0, None)
            table.add_row(
                f"v{plan.version}" if first else "", _short(plan.broker) if first else "",
                (plan.run_id or "swarm-wide") if first else "", "-" if i is None else str(i + 1),
                "-" if group is None else stages_cell(group),
                "-" if group is None else f"{group.tokens_per_s:,.1f}",
                "-" if group is None else ("[green]yes[/green]" if live(group, records) else "[yellow]moving[/yellow]"),
                backups if first else "",
            )
    return table


def stages_cell(group: Group) -> str:
    """``...abcd 0:3 -> ...wxyz 3:6``: a group's stages in pipeline order."""
    return " -> ".join(f"{_short(s.peer_id)} {s.start}:{s.end}" for s in group.stages)


def _short(peer_id: str) -> str:
    return f"...{peer_id[-4:]}"


def print_status(model: str, records: list[PeerRecord], total_blocks: int, console: Console | None = None,
                 plans: list[Plan] | None = None) -> None:
    console = console or Console()
    console.print(status_table(model, records, total_blocks))
    if plans:
        console.print(plans_table(plans, records))
    elif plans is not None:
        console.print("no plan published (peers keep the blocks they chose; clients route on their own)")


def _ranges(blocks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0:3, 5:6'."""
    spans, start = [], None
    for i, b in enumerate(blocks):
        if start is None:
            start = b
        if i + 1 == len(blocks) or blocks[i + 1] != b + 1:
            spans.append(f"{start}:{b + 1}")
            start = None
    return ", ".join(spans)
