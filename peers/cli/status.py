"""The swarm status table: who is online, which blocks they serve, how fast, and what is missing."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from swarm.block_selection import missing_blocks
from swarm.records import PeerRecord, PeerState

_STATE_STYLE = {
    PeerState.ONLINE: "green",
    PeerState.JOINING: "yellow",
    PeerState.BACKUP: "cyan",
    PeerState.OFFLINE: "dim",
}


def status_table(model: str, records: list[PeerRecord], total_blocks: int) -> Table:
    table = Table(title=f"fusionswarm: {model} ({total_blocks} blocks, {len(records)} peers)")
    for column in ("peer", "name", "blocks", "state", "tokens/s per block", "device", "dtype", "version"):
        table.add_column(column, justify="right" if column.startswith("tokens") else "left")
    for r in sorted(records, key=lambda r: (r.start, r.end, r.peer_id)):
        style = _STATE_STYLE[r.state]
        table.add_row(
            f"...{r.peer_id[-8:]}", r.public_name or "-", r.span, f"[{style}]{r.state.value}[/{style}]",
            f"{r.throughput:,.0f}", r.device, r.dtype, r.version or "-",
        )
    missing = missing_blocks(records, total_blocks)
    table.caption = (
        f"[red]missing blocks: {_ranges(missing)}[/red] — start a peer with --block_indices for them"
        if missing
        else "[green]every block is served[/green]"
    )
    return table


def print_status(model: str, records: list[PeerRecord], total_blocks: int, console: Console | None = None) -> None:
    (console or Console()).print(status_table(model, records, total_blocks))


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
