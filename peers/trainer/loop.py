"""The training loop behind ``swarm train`` and the demo: steps with a rich progress bar (step, loss, tokens/s,
each stage's utilisation) and held-out losses through the run's own stage peers."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from peers.model.local import default_position_ids
from peers.trainer.prompt_batch import prompted_logits
from peers.trainer.swarm_trainer import StepResult, SwarmTrainer
from peers.training import TokenBatches, loss_of


class StepFailed(RuntimeError):
    """A training step raised; the message says which step and why."""


def held_out_loss(trainer: SwarmTrainer, windows: torch.Tensor, rows: int = 8) -> float:
    """Mean next-token loss on ``windows`` through the run's own stage peers, ``rows`` windows per request."""
    total, count = 0.0, 0
    with torch.no_grad():
        for chunk in windows.split(max(1, rows)):
            total += loss_of(pipeline_logits(trainer, chunk), chunk).item() * len(chunk)
            count += len(chunk)
    return total / max(count, 1)


def pipeline_logits(trainer: SwarmTrainer, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits through the trainer's stages (the peers it trains), or the client's router if it has none."""
    if getattr(trainer, "prompts", None) is not None:  # a prompt run: with its prompts (``peers.trainer.prompt_batch``)
        with torch.no_grad():
            return trainer.client.loop.run(prompted_logits(trainer, input_ids))
    stages = list(getattr(trainer, "stages", []))
    if not stages or not all(hasattr(s, "peer_id") and hasattr(s, "start") for s in stages):
        return trainer.client.forward(input_ids)
    client = trainer.client

    async def through_stages() -> torch.Tensor:
        hidden = client.embedding.embed(input_ids, default_position_ids(input_ids)).detach().to("cpu", client.dtype)
        for stage in stages:
            hidden = await client.call_forward(stage.peer_id, hidden, stage.start, stage.end)
        return client.head.head(hidden.to(client.device, client.dtype))

    with torch.no_grad():
        return client.loop.run(through_stages())


def stage_labels(trainer: SwarmTrainer, count: int) -> list[str]:
    """``start:end`` of each stage (``stage<i>`` if the trainer's stages are not plain records)."""
    stages = list(getattr(trainer, "stages", []))
    if len(stages) == count and all(hasattr(s, "start") for s in stages):
        return [f"{s.start}:{s.end}" for s in stages]
    return [f"stage{i}" for i in range(count)]


def train_loop(trainer: SwarmTrainer, batches: TokenBatches, steps: int, *, console: Console,
               held_out: torch.Tensor, eval_every: int = 0, eval_rows: int = 8,
               after_step: Callable[[StepResult], None] | None = None) -> dict[str, Any]:
    """Train until ``trainer.steps_done == steps`` with a progress bar; held-out loss at the start, every
    ``eval_every`` steps and at the end. Returns a summary; a failing step raises ``StepFailed``."""
    start_step, t0 = trainer.steps_done, time.perf_counter()
    evals = {start_step: held_out_loss(trainer, held_out, eval_rows)}
    console.print(f"held-out loss at step {start_step}: {evals[start_step]:.4f}")
    tokens, seconds, losses, stage_steps = 0, 0.0, [], []
    busy_seconds = 0.0  # wall time over which ``busy`` was summed (restarts if the pipeline changes shape)
    busy: list[float] = []
    labels: list[str] = []
    columns = (TextColumn("step {task.completed}/{task.total}"), BarColumn(bar_width=20),
               TextColumn("{task.fields[info]}"), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("train", total=steps, completed=start_step, info="")
        upcoming: list[torch.Tensor] | None = None
        while trainer.steps_done < steps:
            step = trainer.steps_done + 1
            micro = upcoming or [batches.next_micro() for _ in range(trainer.accumulation)]
            # staleness 1: the next step's micro-batches start while this one drains
            upcoming = [batches.next_micro() for _ in range(trainer.accumulation)] \
                if getattr(trainer, "staleness", 0) and step < steps else None
            try:
                result = trainer.train_step(micro, upcoming) if upcoming is not None else trainer.train_step(micro)
            except Exception as e:
                raise StepFailed(f"training step {step} failed ({type(e).__name__}: {e})") from e
            tokens, seconds = tokens + result.tokens, seconds + result.seconds
            losses.append(result.loss)
            stage_steps = list(result.stage_steps)
            current = stage_labels(trainer, len(result.stage_busy))
            if current != labels:  # first step, or a failure re-chose a different tiling
                busy, labels, busy_seconds = [0.0] * len(current), current, 0.0
            busy = [b + s for b, s in zip(busy, result.stage_busy, strict=True)]
            busy_seconds += result.seconds
            if after_step is not None:
                after_step(result)
            util = " | ".join(f"{label} {b / max(busy_seconds, 1e-9):.0%}"
                              for label, b in zip(labels, busy, strict=True))
            progress.update(task, completed=trainer.steps_done,
                            info=f"loss {result.loss:.3f}  {tokens / max(seconds, 1e-9):,.0f} tok/s  {util}")
            if eval_every and trainer.steps_done % eval_every == 0 and trainer.steps_done < steps:
                evals[trainer.steps_done] = held_out_loss(trainer, held_out, eval_rows)
                progress.console.print(f"step {trainer.steps_done}: train loss {result.loss:.4f}, "
                                       f"held-out loss {evals[trainer.steps_done]:.4f}")
    if hasattr(trainer, "settle"):
        try:  # a stage that missed the last commit (its peer restarts) gets it replayed before the end
            trainer.settle()
        except Exception as e:
            raise StepFailed(f"replaying step {trainer.steps_done} on a stage that missed its commit failed "
                             f"({type(e).__name__}: {e})") from e
    if trainer.steps_done not in evals:
        evals[trainer.steps_done] = held_out_loss(trainer, held_out, eval_rows)
    console.print(f"held-out loss at step {trainer.steps_done}: {evals[trainer.steps_done]:.4f} "
                  f"(was {evals[start_step]:.4f} at step {start_step})")
    return {
        "run_id": trainer.run_id, "start_step": start_step, "steps_done": trainer.steps_done,
        "held_out_before": evals[start_step], "held_out_after": evals[trainer.steps_done],
        "held_out": {str(k): round(v, 5) for k, v in evals.items()},
        "train_loss_first": losses[0] if losses else None, "train_loss_last": losses[-1] if losses else None,
        "tokens": tokens, "seconds": round(time.perf_counter() - t0, 2),
        "tokens_per_s": round(tokens / seconds, 1) if seconds else 0.0,
        "utilisation": {label: round(b / busy_seconds, 3) for label, b in zip(labels, busy, strict=True)}
        if busy_seconds else {},
        "stage_steps": stage_steps,
        "steps_replayed": getattr(trainer, "replayed", 0),  # on a stage that missed a commit (its peer restarted)
        "lost_steps": [{k: v for k, v in lost.items() if k != "message"}
                       for lost in getattr(trainer, "lost_steps", [])],
    }
