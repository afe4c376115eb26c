"""The monitor's HTML, rendered on the server from ``snapshot.swarm_state``'s dict; a few lines of JavaScript
replace the ``#swarm`` element with ``/fragment`` every ``refresh_s`` seconds. No build step, no external assets."""

from __future__ import annotations

import time
from html import escape
from typing import Any

STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222;background:#fafafa}
h1{font-size:1.4em;margin:0 0 .2em}h2{font-size:1.15em;margin:1.2em 0 .4em}
.note{color:#555}.error{color:#b00}
.bar{display:flex;gap:2px;margin:.4em 0;max-width:100%}
.block{flex:1;min-width:14px;height:28px;display:flex;align-items:center;justify-content:center;font-size:11px;
 color:#fff;border-radius:2px}
.c0{background:#d33}.c1{background:#8bc34a}.c2{background:#4caf50}.c3{background:#2e7d32}
.missing-blocks{color:#d33;font-weight:600}.covered{color:#2e7d32}
table{border-collapse:collapse;font-size:13px;margin:.4em 0;background:#fff}
th,td{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top}th{background:#eee}
td:first-child{white-space:nowrap}
.online{color:#2e7d32}.joining{color:#b8860b}.backup{color:#00838f}.offline{color:#888}
.figure{font-size:1.1em;font-weight:600}
"""

SCRIPT = """
const refresh = %s * 1000;
async function update() {
  try {
    const reply = await fetch('/fragment', {cache: 'no-store'});
    if (reply.ok) { document.getElementById('swarm').innerHTML = await reply.text(); }
  } catch (e) { document.getElementById('stale').textContent = ' (monitor unreachable: ' + e + ')'; return; }
  document.getElementById('stale').textContent = '';
}
setInterval(update, refresh);
"""


def page(state: dict[str, Any]) -> str:
    """The whole page."""
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>fusionswarm monitor</title>"
        f"<style>{STYLE}</style></head><body><h1>fusionswarm monitor</h1>"
        f"<div class='note'>refreshes every {state['refresh_s']:g} s<span id='stale'></span></div>"
        f"<div id='swarm'>{fragment(state)}</div>"
        f"<script>{SCRIPT % float(state['refresh_s'])}</script></body></html>"
    )


def fragment(state: dict[str, Any]) -> str:
    """What the script swaps in: the access note and every model."""
    when = time.strftime("%H:%M:%S", time.localtime(state["generated_at"]))
    parts = [f"<p class='note' id='access'>{escape(state['access'])} · as of {when}</p>"]
    parts += [_model(m) for m in state["models"]]
    return "".join(parts)


def _model(m: dict[str, Any]) -> str:
    name = escape(m["model"])
    head = (f"<section class='model' data-model='{name}'><h2>{name}</h2>"
            f"<div><span class='figure' id='online'>{m['online']} peer(s) online</span> · "
            f"<span class='figure' id='throughput'>{m['tokens_per_s']:,.1f} tokens/s</span> swarm compute through "
            f"all {m['num_blocks']} blocks (weakest block; links not counted)")
    if m["sealed"]:
        head += f" · {m['sealed']} sealed record(s) not readable"
    head += "</div>"
    if m["error"]:
        head += f"<p class='error'>{escape(m['error'])}</p>"
    return head + _coverage(m) + _peers(m) + _plans(m) + "</section>"


def _coverage(m: dict[str, Any]) -> str:
    cells = "".join(
        f"<div class='block c{min(n, 3)}' data-block='{i}' data-peers='{n}' title='block {i}: {n} peer(s)'>{n}</div>"
        for i, n in enumerate(m["coverage"]))
    if m["missing"]:
        spans = ", ".join(f"{a}:{b}" for a, b in m["missing"])
        caption = (f"<p class='missing-blocks' id='missing'>missing blocks: {spans} — start a peer with "
                   f"--block_indices for them</p>")
    else:
        caption = "<p class='covered' id='missing'>every block is served</p>"
    return f"<div class='bar' title='peers serving each block'>{cells}</div>{caption}"


def _peers(m: dict[str, Any]) -> str:
    rows = []
    for p in m["peers"]:
        span = f"{p['start']}:{p['end']}" if p["serves"] else f"none (up to {p['end'] - p['start']})"
        compute = "-" if p["forward_ms"] <= 0 else f"{p['forward_ms']:.3g} / {p['backward_ms']:.3g}"
        links = "<br>".join(
            f"…{escape(x['peer_id'][-4:])} {x['mbit_s']:.3g} Mbit/s {x['rtt_ms']:.1f} ms" if x["mbit_s"] else
            f"…{escape(x['peer_id'][-4:])} ? Mbit/s {x['rtt_ms']:.1f} ms" for x in p["links"]) or "-"
        cache = "-" if p["cache"] is None else f"{p['cache']['used']:,} / {p['cache']['tokens']:,}"
        since = "-" if p["online_since"] is None else time.strftime("%H:%M:%S", time.localtime(p["online_since"]))
        rows.append(
            f"<tr class='peer' data-peer-id='{escape(p['peer_id'])}' data-state='{p['state']}'>"
            f"<td title='{escape(p['peer_id'])}'>…{escape(p['peer_id'][-8:])}</td><td>{escape(p['name']) or '-'}</td>"
            f"<td>{span}</td><td class='{p['state']}'>{p['state']}</td>"
            f"<td>{p['tokens_per_s_per_block']:,.0f}</td><td>{compute}</td><td>{links}</td><td>{cache}</td>"
            f"<td>{escape(p['device'])} {escape(p['dtype'])}</td><td>{escape(p['version']) or '-'}</td>"
            f"<td>{since}</td></tr>")
    head = "".join(f"<th>{h}</th>" for h in (
        "peer", "name", "blocks", "state", "tokens/s per block", "fwd / bwd ms per token per block", "best links",
        "cache tokens used / budget", "device", "version", "online since"))
    return f"<table class='peers'><tr>{head}</tr>{''.join(rows)}</table>"


def _plans(m: dict[str, Any]) -> str:
    if not m["plans"]:
        return ("<p class='note'>no plan published (peers keep the blocks they chose)"
                + (f"; backup pool: {len(m['backups'])} peer(s)" if m["backups"] else "") + "</p>")
    rows = []
    for plan in m["plans"]:
        backups = " ".join(f"…{escape(b[-4:])}" for b in plan["backups"]) or "-"
        for i, g in enumerate(plan["groups"]):
            stages = " → ".join(f"…{escape(s['peer_id'][-4:])} {s['start']}:{s['end']}" for s in g["stages"])
            rows.append(f"<tr class='group'><td>v{plan['version']}</td><td>…{escape(plan['broker'][-4:])}</td>"
                        f"<td>{escape(plan['run_id']) or 'swarm-wide'}</td><td>{i + 1}</td><td>{stages}</td>"
                        f"<td>{g['tokens_per_s']:,.1f}</td><td>{'yes' if g['live'] else 'moving'}</td>"
                        f"<td>{backups if i == 0 else ''}</td></tr>")
    head = "".join(f"<th>{h}</th>" for h in ("plan", "broker", "run", "group", "stages", "est. tokens/s", "serving",
                                              "backup pool"))
    return f"<h3>pipeline groups</h3><table class='plans'><tr>{head}</tr>{''.join(rows)}</table>"
