"""``swarm demo``: a whole swarm on this machine with no arguments, and everything it started stopped."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from rich.console import Console

from peers.launch import LocalSwarm

logger = logging.getLogger(__name__)

DEMO_MODEL = dict(family="llama", hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4,
                  intermediate_size=688, seed=0)
PROMPT = "A swarm of ordinary computers serves one model."


def ensure_demo_model(workdir: Path) -> Path:
    """The demo's tiny Llama, made once (random init) in ``workdir/models``."""
    from peers.model import make_tiny_model

    path = Path(workdir) / "models" / "llama-tiny"
    if not (path / "config.json").is_file():
        make_tiny_model(path, **DEMO_MODEL)
    return path


def run_demo(workdir: Path) -> int:
    from tokenizers import Tokenizer

    from peers.client import SwarmClient
    from peers.config import ClientConfig
    from peers.model import LocalModel
    from peers.status import print_status

    console = Console()
    workdir = Path(workdir)
    console.rule("[bold]fusionswarm demo")
    model_dir = ensure_demo_model(workdir)
    console.print(f"Model: {model_dir} (tiny Llama, {DEMO_MODEL['num_layers']} blocks, random weights)")
    t0 = time.perf_counter()
    with LocalSwarm(workdir, update_period=2.0, private=True) as swarm:
        console.print(f"Private swarm {swarm.owner.swarm_id[:16]}...: the owner invites each process; records are "
                      f"signed and encrypted, and peers serve only members")
        with console.status("Starting the bootstrap peer ..."):
            initial_peers = swarm.start_dht()
        console.print(f"Bootstrap peer up: --initial_peers {' '.join(initial_peers)}")
        for name, kwargs in (("peer-a", {"block_indices": "0:3"}), ("peer-b", {"block_indices": "3:6"}),
                             ("peer-c", {"num_blocks": 2})):
            with console.status(f"Starting {name} ({kwargs}) ..."):
                proc = swarm.start_peer(model_dir, name=name, extra=["--public_name", name], **kwargs)
            console.print(f"{name} serves blocks {proc.blocks[0]}:{proc.blocks[1]} (pid {proc.pid})")

        with console.status("Connecting a client (member 'client') ..."):
            client = SwarmClient(model_dir, config=ClientConfig(swarm=swarm.swarm_config("client")))
        try:
            _show_outsider(console, swarm, model_dir)
            tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
            input_ids = torch.tensor([tokenizer.encode(PROMPT).ids])
            with console.status("Forward through the swarm ..."):
                t1 = time.perf_counter()
                logits = client.forward(input_ids)
                swarm_ms = 1e3 * (time.perf_counter() - t1)
            local = LocalModel.from_dir(model_dir)
            reference, _ = local(input_ids)
            diff = (logits - reference).abs().max().item()
            print_status(client.model_name, client.records(), client.model_config.num_layers, console)
            generated_ok = _generate(console, client, local, input_ids)
        finally:
            client.close()
    ok = diff < 1e-4 and generated_ok
    console.print(
        f"Forward of {input_ids.shape[1]} tokens through 3 peers: {swarm_ms:.1f} ms; "
        f"max |swarm - local| logits = {diff:.2e} "
        + ("[green]match[/green]" if diff < 1e-4 else "[red]MISMATCH[/red]")
    )
    console.print(f"Stopped every process the demo started ({time.perf_counter() - t0:.1f} s in all).")
    return 0 if ok else 1


def _show_outsider(console: Console, swarm: LocalSwarm, model_dir: Path) -> None:
    """A client without credentials that knows the bootstrap address: it sees no records and is refused."""
    from peers.client import SwarmClient
    from peers.config import ClientConfig, SwarmConfig

    with console.status("An outsider (no invite) tries the same swarm ..."):
        with SwarmClient(model_dir, config=ClientConfig(swarm=SwarmConfig(initial_peers=tuple(swarm.initial_peers)),
                                                        request_timeout=10)) as outsider:
            readable = outsider.records()
            try:
                outsider.info(swarm.processes[1].peer_id)
                refused = "[red]was served[/red]"
            except Exception as e:
                refused = f"refused ({str(e).split(':')[-1].strip()[:60]}...)"
    console.print(f"Outsider: {len(readable)} readable records; its request to a peer was {refused}")


def _generate(console: Console, client, local, input_ids: torch.Tensor, new_tokens: int = 24) -> bool:
    """Greedy generation through the swarm, tokens shown as they come; compared with the local model."""
    console.print(f"Generating {new_tokens} tokens through the swarm over end-to-end encrypted streams "
                  "(greedy; random weights, so the text is noise):")
    t0, got = time.perf_counter(), []
    for token in client.iter_generate(input_ids, new_tokens):
        got.append(int(token[0]))
        console.print(f" {got[-1]}", end="", highlight=False)
    seconds = time.perf_counter() - t0
    expected = local.generate_greedy(input_ids, new_tokens)[0, input_ids.shape[1]:].tolist()
    same = got == expected
    console.print(
        f"\n{1e3 * seconds / new_tokens:.1f} ms per token; tokens "
        + ("[green]equal the local model's greedy output[/green]" if same else "[red]DIFFER from the local model[/red]")
    )
    return same
