"""``swarm demo``: a whole swarm on this machine with no arguments, and everything it started stopped.

Its peers let any member of its private swarm train them (``--trainers members``). It trains the tiny model
briefly through the three peers (this process, a member, is the trainer), then checks that the
swarm serves the trained weights: forward and greedy generation through the swarm are compared with one
local model built from the trainer's embedding + head and the blocks the peers saved after the last step.
"""

from __future__ import annotations

import copy
import logging
import shutil
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape

from peers.cli.launch import LocalSwarm

logger = logging.getLogger(__name__)

DEMO_MODEL = dict(family="llama", hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4,
                  intermediate_size=688, seed=0)
PROMPT = "A swarm of ordinary computers serves one model."
TRAIN_STEPS, SEQ_LEN, MICRO_BATCH, ACCUMULATION, IN_FLIGHT = 30, 64, 4, 2, 4


def ensure_demo_model(workdir: Path) -> Path:
    """The demo's tiny Llama, made once (random init) in ``workdir/models``."""
    from peers.model import make_tiny_model

    path = Path(workdir) / "models" / "llama-tiny"
    if not (path / "config.json").is_file():
        make_tiny_model(path, **DEMO_MODEL)
    return path


def run_demo(workdir: Path) -> int:
    from tokenizers import Tokenizer

    from peers.cli.status import print_status
    from peers.client.swarm_client import SwarmClient
    from peers.core.config import ClientConfig

    console = Console()
    workdir = Path(workdir)
    console.rule("[bold]fusionswarm demo")
    model_dir = ensure_demo_model(workdir)
    checkpoints = workdir / "checkpoints"  # where the peers save their trained blocks
    shutil.rmtree(checkpoints, ignore_errors=True)
    console.print(f"Model: {model_dir} (tiny Llama, {DEMO_MODEL['num_layers']} blocks, random initial weights)")
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
                proc = swarm.start_peer(model_dir, name=name, **kwargs, trainers="members",  # any invited member
                                        extra=["--public_name", name, "--checkpoint_dir", str(checkpoints)])
            console.print(f"{name} serves blocks {proc.blocks[0]}:{proc.blocks[1]} (pid {proc.pid})")

        with console.status("Connecting a client (member 'client') ..."):
            client = SwarmClient(model_dir, config=ClientConfig(swarm=swarm.swarm_config("client")))
        try:
            _show_outsider(console, swarm, model_dir)
            local = _train(console, client, checkpoints)
            tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
            input_ids = torch.tensor([tokenizer.encode(PROMPT).ids])
            with console.status("Forward through the swarm ..."):
                t1 = time.perf_counter()
                logits = client.forward(input_ids)
                swarm_ms = 1e3 * (time.perf_counter() - t1)
            with torch.no_grad():
                reference, _ = local(input_ids)
            diff = (logits - reference).abs().max().item()
            print_status(client.model_name, client.records(), client.model_config.num_layers, console)
            generated_ok = _generate(console, client, local, input_ids, tokenizer)
        finally:
            client.close()
    ok = diff < 1e-4 and generated_ok
    console.print(
        f"Forward of {input_ids.shape[1]} tokens through 3 peers: {swarm_ms:.1f} ms; "
        f"max |swarm - local trained model| logits = {diff:.2e} "
        + ("[green]match[/green]" if diff < 1e-4 else "[red]MISMATCH[/red]")
    )
    console.print(f"Stopped every process the demo started ({time.perf_counter() - t0:.1f} s in all).")
    return 0 if ok else 1


def _train(console: Console, client, checkpoints: Path):
    """Train ``TRAIN_STEPS`` steps through the peers on the built-in corpus; return the trained local model."""
    from peers.cli.train import token_ids, wait_for_pipeline
    from peers.trainer.loop import train_loop
    from peers.trainer.swarm_trainer import SwarmTrainer
    from peers.training import OptimConfig, TokenBatches, read_corpus

    optim = OptimConfig(lr=3e-3, warmup_steps=3, schedule="cosine", total_steps=TRAIN_STEPS)
    with console.status("Reading the built-in corpus (stdlib docstrings) ..."):
        batches = TokenBatches(token_ids(client.model_dir, read_corpus(None)), SEQ_LEN, MICRO_BATCH, seed=0)
    # the peers checkpoint their blocks after the last step: the local reference model is built from those
    trainer = SwarmTrainer(client, optim, ACCUMULATION, in_flight=IN_FLIGHT, checkpoint_every=TRAIN_STEPS)
    with console.status("Waiting for peers whose spans tile the model ..."):
        wait_for_pipeline(trainer, 60.0)
    stages = " -> ".join(f"{s.start}:{s.end}" for s in trainer.stages)
    console.print(f"Training {TRAIN_STEPS} steps through stages {stages} (run {trainer.run_id}): this process owns "
                  f"the embedding + head, each peer its blocks; {ACCUMULATION} micro-batches of {MICRO_BATCH}x"
                  f"{SEQ_LEN} tokens per step, held-out loss on text never trained on:")
    summary = train_loop(trainer, batches, TRAIN_STEPS, console=console, held_out=batches.held_out_windows(16),
                         eval_every=10, eval_rows=MICRO_BATCH)
    console.print(f"{summary['tokens']:,} tokens in {summary['seconds']:.1f} s; stage utilisation "
                  + ", ".join(f"{k} {v:.0%}" for k, v in summary["utilisation"].items()))
    return _trained_local_model(client, trainer, checkpoints)


def _trained_local_model(client, trainer, checkpoints: Path):
    """A ``LocalModel`` from the trainer's embedding + head and the blocks each peer saved at the last step."""
    from safetensors.torch import load_file

    from peers.model import LocalModel, load_blocks
    from peers.training.state import read_state_info, stage_checkpoint_path

    n = client.model_config.num_layers
    blocks, state = load_blocks(client.model_dir, 0, n), {}
    for stage in trainer.stages:
        folder = stage_checkpoint_path(checkpoints, trainer.run_id, stage.start, stage.end)
        step = read_state_info(folder)["step"]
        if step != trainer.steps_done:
            raise RuntimeError(f"peer of blocks {stage.start}:{stage.end} saved step {step}, not {trainer.steps_done}")
        for key, tensor in load_file(str(folder / "weights.safetensors")).items():
            index, rest = key.split(".", 1)
            state[f"{stage.start + int(index)}.{rest}"] = tensor
    blocks.load_state_dict(state, strict=True)
    embedding, head = copy.deepcopy((client.embedding, client.head))  # one deepcopy keeps a tied head tied
    return LocalModel(client.model_config, embedding, blocks, head).eval()


def _show_outsider(console: Console, swarm: LocalSwarm, model_dir: Path) -> None:
    """A client without credentials that knows the bootstrap address: it sees no records and is refused."""
    from peers.client.swarm_client import SwarmClient
    from peers.core.config import ClientConfig, SwarmConfig

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


def _generate(console: Console, client, local, input_ids: torch.Tensor, tokenizer, new_tokens: int = 24) -> bool:
    """Greedy generation through the swarm, token ids shown as they come; compared with the trained local model."""
    console.print(f"Generating {new_tokens} tokens through the swarm over end-to-end encrypted streams (greedy; "
                  f"after {TRAIN_STEPS} steps the tiny model knows which bytes are common, not words yet):")
    t0, got = time.perf_counter(), []
    for token in client.iter_generate(input_ids, new_tokens):
        got.append(int(token[0]))
        console.print(f" {got[-1]}", end="", highlight=False)
    seconds = time.perf_counter() - t0
    expected = local.generate_greedy(input_ids, new_tokens)[0, input_ids.shape[1]:].tolist()
    same = got == expected
    console.print(f"\ntext: {escape(repr(tokenizer.decode(got)))}", highlight=False)
    console.print(
        f"{1e3 * seconds / new_tokens:.1f} ms per token; tokens "
        + ("[green]equal the trained local model's greedy output[/green]" if same
           else "[red]DIFFER from the trained local model[/red]")
    )
    return same
