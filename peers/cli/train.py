"""``swarm train CONFIG.toml``: train a model on the swarm's stage peers; this process is the trainer.

The trainer owns the embedding + head and their AdamW; each stage peer owns its blocks and theirs
(``peers.trainer.swarm_trainer``). Token ids come from the model's ``tokenizer.json``; when that is the tiny models'
byte-level tokenizer (ids = UTF-8 bytes), ``encode_bytes`` gives the same ids without the slow pass.

Checkpoints: the trainer's part goes to ``checkpoint_dir/<run_id>/trainer`` every ``checkpoint_every``
steps and at the end; rerunning with the same run_id (default: the config file's name) resumes there
(weights, AdamW state, step, data position). Peers save and resume their own blocks (``--checkpoint_dir``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape

from peers.cli.options import model_name_flag, swarm_config, swarm_flags
from peers.core.config import TOPOLOGIES
from peers.core.ids import safe_name
from peers.trainer.loop import StepFailed, stage_labels, train_loop
from peers.trainer.state import (
    has_trainer_state,
    load_trainer_state,
    save_trainer_state,
    trainer_checkpoint_path,
)
from peers.trainer.swarm_trainer import StepResult, SwarmTrainer
from peers.training import TokenBatches, TrainConfig, encode_bytes, encode_with_tokenizer, read_corpus
from peers.training.state import read_state_info
from privacy.peer_ids import short_id

logger = logging.getLogger(__name__)

GEOMETRY = ("seq_len", "micro_batch", "batch_size", "seed")  # must not change when a run resumes
_PROBE = "Byte probe: é, ü, 1\n"


def add_train_command(sub) -> None:

    train = sub.add_parser("train", help="train a model on the swarm's stage peers (this process: embedding + head)")
    train.add_argument("config", type=Path, help="training config (TOML), e.g. examples/train_tiny.toml")
    swarm_flags(train, joining=True, new_swarm=False)
    train.add_argument("--steps", type=int, default=None,
                       help="train until this step (default: the config's steps); beyond the config's [optim] "
                            "total_steps the lr stays at its floor: raise total_steps there to extend the schedule")
    model_name_flag(train)
    train.add_argument("--run_id", default=None,
                       help="run name shared with the peers (default: the config file's name, so a rerun resumes)")
    train.add_argument("--eval_every", type=int, default=10, help="held-out loss every N steps (0: start and end)")
    train.add_argument("--eval_windows", type=int, default=16, help="held-out windows per evaluation")
    train.add_argument("--wait_peers", type=float, default=60.0,
                       help="seconds to wait for peers whose spans tile the model, at the start and whenever a "
                            "stage's peer is gone mid-run (e.g. while it restarts)")
    train.add_argument("--request_timeout", type=float, default=60.0, help="deadline of one RPC, seconds")
    train.add_argument("--device", default="auto",
                       help="where this process trains the embedding and head: auto (cuda when a GPU is visible, "
                            "else cpu), cpu, cuda, cuda:1, ...; they train in float32 (master weights) everywhere")
    train.add_argument("--topology", choices=TOPOLOGIES, default=None,
                       help="chain: each stage hands its output straight to the next one (this process's link carries "
                            "the first stage's input and the last one's output only); star: every hidden state and "
                            "gradient goes through this process (default: chain; star for prompt tuning, which runs "
                            "in the star topology only)")
    train.add_argument("--compression", default=None,
                       help="how hidden states and grads travel between stages (default: the config's): none "
                            "(bit-exact), fp16, bf16, int8, topk:FRACTION[/int8] or adaptive (per link: compressed "
                            "only as much as the link needs to keep up with the stages' compute)")
    train.add_argument("--staleness", type=int, choices=(0, 1), default=None,
                       help="1: asynchronous steps: the next step's forwards start while one drains and commits, and "
                            "each step's gradients are taken at the weights before the previous update (for slow "
                            "links); 0: synchronous, bit-exact with one process (default: the config's, else 0)")
    train.add_argument("--plan", action="store_true",
                       help="be the broker of this run: plan it from the swarm's peers and links, publish the plan "
                            "(signed), wait for the peers that allow this trainer to move to it, and train on its "
                            "group nearest this process; a failed stage is re-planned around (a backup takes over)")
    train.set_defaults(func=_cmd_train)


def steps_warning(config: TrainConfig, steps: int, config_path: str | Path) -> str:
    """Why training until ``steps`` may not do what one expects ('' if it does): steps past the lr schedule's
    ``total_steps`` all run at its floor lr."""
    optim = config.optim
    if not optim.total_steps or optim.schedule == "constant" or steps <= optim.total_steps:
        return ""
    floor = optim.lr * optim.min_lr_ratio
    return (f"training until step {steps}, past the lr schedule's end (total_steps = {optim.total_steps} under "
            f"[optim] in {config_path}): steps {optim.total_steps + 1}..{steps} all run at the floor lr {floor:g} "
            f"(min_lr_ratio x lr). To extend the schedule, set total_steps = {steps} under [optim] in "
            f"{config_path} (a resumed run follows the new schedule from its current step)")


def default_run_id(config_path: str | Path) -> str:
    """The config file's name without suffix, reduced to ``[A-Za-z0-9._-]``."""
    stem = Path(config_path).stem
    return safe_name(stem)


def token_ids(model_dir: str | Path, text: str) -> torch.Tensor:
    """``text`` as the model's token ids (see the module docstring for the byte-level shortcut)."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} has no tokenizer.json: put the model's tokenizer.json (Hugging Face fast "
                         "tokenizer) into the model folder")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    if tokenizer.get_vocab_size(with_added_tokens=False) == 256 and \
            tokenizer.encode(_PROBE, add_special_tokens=False).ids == list(_PROBE.encode()):
        return encode_bytes(text)
    return encode_with_tokenizer(model_dir, text)


def wait_for_pipeline(trainer: SwarmTrainer, timeout: float) -> None:
    """Wait until the online peers' spans tile the model, then open the run on every stage."""
    from swarm.stages import NoPipelineError

    client, n = trainer.client, trainer.client.model_config.num_layers
    try:
        trainer.start(wait=timeout)
    except NoPipelineError as e:
        half = n // 2
        private = "" if client.records() else (" No peer of this model is visible: check --initial_peers and, for "
                                               "a private swarm, --private CREDENTIALS --identity_path ID.")
        raise RuntimeError(
            f"no training pipeline after {timeout:.0f} s: {e}.{private} Start peers of "
            f"{client.model_name} whose --block_indices tile blocks 0:{n} (e.g. `swarm peer MODEL "
            f"--block_indices 0:{half}` and `--block_indices {half}:{n}`), then rerun") from None
    except Exception as e:
        raise RuntimeError(f"opening run {trainer.run_id!r} on the stage peers failed ({type(e).__name__}: {e}); "
                           "check --initial_peers; a peer that is busy, or does not allow this trainer (its "
                           "--trainers), must be replaced by another peer of the same span") from e


def _resume(trainer: SwarmTrainer, path: Path, config: TrainConfig, batches: TokenBatches,
            console: Console) -> bool:
    """Load the trainer's checkpoint at ``path`` if there is one; skip the data already trained on."""
    if not has_trainer_state(path):
        return False
    info = read_state_info(path)
    changed = ", ".join(f"{k}={info.get(k)!r} -> {getattr(config, k)!r}" for k in GEOMETRY
                        if info.get(k) != getattr(config, k))
    if changed:
        raise ValueError(f"run {trainer.run_id!r} was checkpointed at {path} with other settings ({changed}): "
                         "restore them in the config to resume, or pass --run_id NEW to start a new run")
    load_trainer_state(trainer, path)
    batches.skip(int(info.get("micro_batches_drawn", 0)))
    console.print(f"Resumed run {escape(trainer.run_id)} at step {trainer.steps_done} from {escape(str(path))}")
    return True


def _cmd_train(args: argparse.Namespace) -> int:
    from peers.client.swarm_client import SwarmClient
    from peers.core.config import ClientConfig

    config = TrainConfig.from_toml(args.config)
    if args.compression is not None:
        config = dataclasses.replace(config, compression=args.compression)  # checked again
    steps = config.steps if args.steps is None else args.steps
    if steps < 1 or args.eval_every < 0 or args.eval_windows < 1:
        raise ValueError("--steps and --eval_windows must be >= 1 and --eval_every >= 0")
    swarm = swarm_config(args)
    if not swarm.initial_peers:
        raise ValueError("pass --initial_peers: the line `swarm dht` printed")
    if warning := steps_warning(config, steps, args.config):
        logger.warning("%s", warning)
    run_id = args.run_id or default_run_id(args.config)
    console = Console()
    batches = TokenBatches(token_ids(config.model_dir, read_corpus(config.data)), config.seq_len,
                           config.micro_batch, config.seed)
    held_out = batches.held_out_windows(args.eval_windows)
    # an adapter run's held-out losses run with its adapters (the peers apply them to our requests only)
    client_config = ClientConfig(swarm=swarm, model_name=args.model_name or config.model_name,
                                 request_timeout=args.request_timeout, device=args.device,
                                 adapter=run_id if config.adapter else "")
    try:
        client = SwarmClient(config.model_dir, config=client_config)
    except (ValueError, RuntimeError):
        raise
    except Exception as e:
        raise RuntimeError(f"cannot join the swarm ({type(e).__name__}: {e}): check --initial_peers and that "
                           "`swarm dht` runs there; a private swarm also needs --private and --identity_path") from e
    with client:
        _print_trainer_id(client, swarm.identity_path, console)
        topology = args.topology or ("star" if config.prompts else "chain")
        trainer = SwarmTrainer(client, config.optim, config.accumulation, in_flight=config.in_flight, run_id=run_id,
                               keep_activations=config.keep_activations, checkpoint_every=config.checkpoint_every,
                               average_every=config.average_every, outer_lr=config.outer_lr,
                               outer_momentum=config.outer_momentum, rechoose_every=config.rechoose_every,
                               pipeline_wait=args.wait_peers,  # also for a stage's peer that restarts mid-run
                               topology=topology, plan=args.plan, compression=config.compression,
                               staleness=config.staleness if args.staleness is None else args.staleness,
                               stale_micro_batches=config.stale_micro_batches or None,
                               adapter=config.adapter, adapter_seed=config.seed,
                               prompts=config.prompts, deep_prompts=config.deep_prompts, prompt_seed=config.seed)
        path = trainer_checkpoint_path(config.checkpoint_dir, run_id) if config.checkpoint_dir else None
        resumed = path is not None and _resume(trainer, path, config, batches, console)
        extra = {**{k: getattr(config, k) for k in GEOMETRY}, "model": client.model_name,
                 "tokens": len(batches.tokens) + len(batches.held_out)}
        saved_at = [trainer.steps_done] if resumed else []
        first = trainer.steps_done

        def save() -> None:
            drawn = batches.drawn - trainer.ahead_batches  # (staleness 1: the next step's are not trained on yet)
            save_trainer_state(trainer, path, {**extra, "micro_batches_drawn": drawn})
            saved_at.append(trainer.steps_done)

        def after_step(result: StepResult) -> None:
            if trainer.steps_done == first + 1:
                _check_stage_steps(trainer, result, console)
            if path is not None and config.checkpoint_every and trainer.steps_done % config.checkpoint_every == 0:
                save()

        wait_for_pipeline(trainer, args.wait_peers)
        stages = " -> ".join(f"{s.start}:{s.end}@{short_id(s.peer_id)}" for s in trainer.stages)
        console.print(f"Run {escape(run_id)}: {client.model_name} through stages {stages}; step {first} of {steps}")
        if first >= steps:
            console.print(f"The run is already at step {first}: nothing to train (pass --steps N to go further)")

        def last_checkpoint() -> str:
            return f"the last checkpoint is step {saved_at[-1]} in {path}" if saved_at else "no checkpoint was saved"

        try:
            summary = train_loop(trainer, batches, steps, console=console, held_out=held_out,
                                 eval_every=args.eval_every, eval_rows=min(config.micro_batch, 8),
                                 after_step=after_step)
        except StepFailed as e:
            raise RuntimeError(f"{e}. Check `swarm status`, restart missing peers (same --checkpoint_dir) and rerun "
                               f"the same command to resume; {last_checkpoint()}") from e
        except KeyboardInterrupt:
            console.print(f"Interrupted at step {trainer.steps_done}; rerun the same command to resume "
                          f"({escape(last_checkpoint())})")
            raise
        if path is not None and (not saved_at or saved_at[-1] != trainer.steps_done):
            save()
    summary.update(resumed=resumed, checkpoint=str(path) if path else None, topology=topology,
                   falling=math.isfinite(summary["held_out_after"])
                   and summary["held_out_after"] < summary["held_out_before"])
    print("summary " + json.dumps(summary), flush=True)
    return 0


def _check_stage_steps(trainer: SwarmTrainer, result: StepResult, console: Console) -> None:
    """Warn when a stage's step count differs from the trainer's (a peer kept state the trainer did not)."""
    labels = stage_labels(trainer, len(result.stage_steps))
    off = [f"{label} is at step {s}" for label, s in zip(labels, result.stage_steps, strict=True)
           if s != trainer.part.step_count]
    if off:
        console.print(f"[yellow]warning:[/yellow] {escape(', '.join(off))} but the trainer is at step "
                      f"{trainer.part.step_count}: the peers' blocks and this trainer's checkpoint are from "
                      "different steps (a peer kept training after the trainer's last checkpoint, or restarted "
                      "from an older one). Training continues; for an exact resume keep checkpoint_every equal "
                      "on both sides and restart peers and trainer together.")


def _print_trainer_id(client, identity_path: Path | None, console: Console) -> None:
    """Peers train only for the trainers their operators allow (``swarm peer --trainers``): say who we are."""
    from privacy.peer_ids import peer_id_of

    peer_id = peer_id_of(client.identity.public_bytes)
    console.print(f"Trainer peer id: {peer_id} (stage peers must allow it: swarm peer ... --trainers {peer_id})")
    if identity_path is None:
        console.print("[yellow]warning:[/yellow] no --identity_path: this peer id is new on every run; pass "
                      "--identity_path FILE to keep it, so peers can keep allowing it")
