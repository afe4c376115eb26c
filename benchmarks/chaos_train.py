"""Training under chaos (``python benchmarks/chaos.py --mode train``): the method is in chaos.py's docstring."""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter
from pathlib import Path

from chaos import Chaos, LogTap, progress_bar, public_events, scan_peer_logs

from peers.cli.launch import LocalSwarm
from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig
from peers.model import make_tiny_model
from peers.trainer.loop import held_out_loss
from peers.trainer.swarm_trainer import SwarmTrainer
from peers.training import LocalTrainer, OptimConfig, TokenBatches, encode_bytes, read_corpus
from peers.training.state import read_state_info

MODEL = dict(family="llama", hidden_size=64, num_layers=6, num_heads=4, num_kv_heads=2, intermediate_size=128)
SPANS = [(0, 2), (2, 4), (4, 6)]
SEQ_LEN, MICRO_BATCH, ACCUMULATION, IN_FLIGHT = 64, 4, 4, 4
EVAL_WINDOWS, EVAL_ROWS = 32, 8
RUN_ID, SEED = "chaos", 0
GIVE_UP = 180.0  # seconds one step may keep failing before the run is abandoned
REQUEST_TIMEOUT, RECHOOSE_EVERY, WAIT_PEERS = 60.0, 30.0, 60.0  # `swarm train`'s defaults (--wait_peers)


# when, within the step after a kill step, the victim dies: kills alternate between these
PHASES = ("mid-step", "before its commit")


def optim_config(steps: int) -> OptimConfig:
    return OptimConfig(lr=3e-3, warmup_steps=3, schedule="cosine", total_steps=steps, clip_norm=1.0, weight_decay=0.01)


def batches() -> TokenBatches:
    return TokenBatches(encode_bytes(read_corpus()), SEQ_LEN, MICRO_BATCH, seed=SEED)


def reference(model_dir: Path, steps: int) -> tuple[list[float], float]:
    """The same steps in one process, without kills: step losses and held-out loss (same chunks and sums as
    ``held_out_loss``)."""
    trainer = LocalTrainer(model_dir, optim_config(steps), ACCUMULATION, stages=SPANS)
    data = batches()
    losses = [trainer.train_step([data.next_micro() for _ in range(ACCUMULATION)]) for _ in range(steps)]
    total, count = 0.0, 0
    for chunk in data.held_out_windows(EVAL_WINDOWS).split(EVAL_ROWS):
        total += trainer.evaluate(chunk) * len(chunk)
        count += len(chunk)
    return losses, total / count


def kill_before_commits(trainer: SwarmTrainer, chaos: Chaos, armed: dict) -> None:
    """When ``armed`` holds a victim, SIGKILL it after the step's last backward and before its ``train_apply``:
    the window in which a lone stage's death used to leave a step half-applied."""
    commit = trainer._commit

    async def kill_then_commit(stage_steps):
        if (victim := armed.pop("victim", None)) is not None:
            chaos.kill(victim, **armed.pop("info"))
            victim.proc.popen.wait(10)
        await commit(stage_steps)

    trainer._commit = kill_then_commit


def run_train(args, workdir: Path) -> dict:
    steps = args.steps
    kills = args.kill_steps if args.kill_steps is not None else [steps // 4, steps // 2, 3 * steps // 4]
    kill_steps = sorted({k for k in kills if 1 <= k < steps})
    model_dir = make_tiny_model(workdir / "llama-chaos-train", seed=SEED, **MODEL)
    tap = LogTap(workdir / "logs" / "trainer.log")
    errors: list[dict] = []
    commits: list[float] = []
    losses: list[float] = []
    abandoned, last = None, None
    try:
        # train=True: every peer gets `--trainers <our trainer's peer id>` (training is opt-in for peers)
        with LocalSwarm(workdir, update_period=args.update_period, train=True) as swarm, progress_bar() as progress:
            swarm.start_dht()
            chaos = Chaos(swarm, model_dir, args.restart_after)
            peers = [(f"stage{i}", span) for i, span in enumerate(SPANS)]
            peers[2:2] = [(f"stage1-replica{r}", SPANS[1]) for r in range(1, args.train_replicas + 1)]
            for name, (a, b) in peers:
                chaos.add(name, f"{a}:{b}", ["--checkpoint_dir", str(workdir / "ckpt" / name)])
            chaos.start()
            by_name = {slot.name: slot for slot in chaos.slots}  # victims in turn: 2:4, 4:6, 2:4's replicas, 0:2
            order = [by_name["stage1"], by_name["stage2"], *(by_name[n] for n, _ in peers[2:-1]), by_name["stage0"]]
            config = ClientConfig(swarm=swarm.trainer_config(), request_timeout=REQUEST_TIMEOUT)
            flags = ["--trainers", swarm.trainer_id()]
            try:
                with SwarmClient(model_dir, config=config) as client:
                    client.wait_for_records(len(chaos.slots))
                    trainer = SwarmTrainer(client, optim_config(steps), ACCUMULATION, in_flight=IN_FLIGHT,
                                           run_id=RUN_ID, checkpoint_every=args.checkpoint_every,
                                           average_every=args.average_every if args.train_replicas else 0,
                                           rechoose_every=RECHOOSE_EVERY, pipeline_wait=WAIT_PEERS)
                    trainer.start(wait=60)
                    armed: dict = {}
                    kill_before_commits(trainer, chaos, armed)
                    data = batches()
                    held = data.held_out_windows(EVAL_WINDOWS)
                    loss_before = held_out_loss(trainer, held, EVAL_ROWS)
                    task = progress.add_task("chaos: training", total=steps)
                    commits.append(time.perf_counter())
                    chaos.origin = commits[0]
                    for step in range(1, steps + 1):
                        micro = [data.next_micro() for _ in range(ACCUMULATION)]
                        first_try, result = time.perf_counter(), None
                        while result is None and time.perf_counter() - first_try < GIVE_UP:
                            try:
                                result = trainer.train_step(micro)
                            except Exception as e:  # `swarm train` would stop here (StepFailed)
                                errors.append({"step": step, "at_s": round(time.perf_counter() - commits[0], 2),
                                               "error": f"{type(e).__name__}: {e}"[:300]})
                                trainer.part.zero_grad()  # start the step afresh, as a restarted trainer would
                                time.sleep(1.0)
                        if result is None:
                            abandoned = step
                            break
                        last = result
                        commits.append(time.perf_counter())
                        losses.append(result.loss)
                        if step in kill_steps:
                            gaps = [b - a for a, b in zip(commits[1:], commits[2:], strict=False)] or [0.2]
                            victim = order[kill_steps.index(step) % len(order)]
                            info = {"after_step": step, "phase": PHASES[kill_steps.index(step) % len(PHASES)]}
                            if info["phase"] == "before its commit":
                                armed.update(victim=victim, info=info)
                            else:
                                timer = threading.Timer(statistics.median(gaps) / 2, chaos.kill, (victim,), info)
                                timer.daemon = True
                                timer.start()
                        progress.update(task, completed=step, description=(
                            f"chaos: loss {result.loss:.3f}, {len(chaos.events)} kills, {len(errors)} errors"))
                    trainer.settle()  # as `swarm train` does at the end: a stage that missed a commit replays it
                    loss_after = held_out_loss(trainer, held, EVAL_ROWS) if abandoned is None else None
                    stage_steps, steps_done = list(last.stage_steps) if last else [], trainer.steps_done
                    pipeline = [[f"{r.start}:{r.end}@...{r.peer_id[-6:]}" for r in g] for g in trainer.replicas]
                    in_run = {r.peer_id for g in trainer.replicas for r in g}
            finally:
                chaos.stop()
            peer_steps = {}
            for slot in chaos.slots:
                state = workdir / "ckpt" / slot.name / RUN_ID / f"blocks-{slot.span.replace(':', '-')}"
                try:
                    peer_steps[slot.name] = read_state_info(state)["step"]
                except ValueError:
                    peer_steps[slot.name] = None
    finally:
        tap.close()
    gaps = [b - a for a, b in zip(commits, commits[1:], strict=False)]
    median_gap = statistics.median(gaps[1:] or gaps)
    kills = chaos.events
    for i, kill in enumerate(kills):
        until = kills[i + 1]["_t"] if i + 1 < len(kills) else float("inf")
        during = [g for g, end in zip(gaps, commits[1:], strict=True) if kill["_t"] < end <= until]
        kill["stall_s"] = round(max(during, default=median_gap) - median_gap, 2)
    lone = {span for span, n in Counter(slot.span for slot in chaos.slots).items() if n == 1}
    for kill in kills:  # a lone stage's stall: its restart, then how long the run took to use it again
        if "serving_again_after_s" in kill and kill["span"] in lone:
            serving = kill["_t"] + kill["serving_again_after_s"]
            resumed = next((end for end in commits if end > serving), None)
            kill["peer_startup_s"] = round(kill["serving_again_after_s"] - args.restart_after, 2)
            kill["first_commit_after_it_served_s"] = round(resumed - serving, 2) if resumed else None
    stalls = [k["stall_s"] for k in kills]
    in_pipeline = {slot.name for slot in chaos.slots if slot.peer_id in in_run}
    behind = {name: steps_done - s for name, s in peer_steps.items() if s is not None and name in in_pipeline}
    redone = tap.count(r"retrying step") + len(errors)
    out = {
        "model": {**MODEL, "dtype": "float32"}, "stages": [f"{a}:{b}" for a, b in SPANS],
        "replicas_of_2:4": 1 + args.train_replicas, "steps": steps, "kill_after_steps": kill_steps,
        "tokens_per_step": SEQ_LEN * MICRO_BATCH * ACCUMULATION, "in_flight": IN_FLIGHT,
        "checkpoint_every": args.checkpoint_every, "restart_after_s": args.restart_after,
        "peer_training_flags": flags, "median_step_s": round(median_gap, 3),
        "stall_s": {"max": max(stalls, default=None), "per_kill": stalls},
        "steps_done": steps_done, "abandoned_at_step": abandoned, "stage_steps_reported": stage_steps,
        "peer_checkpoint_steps": peer_steps,
        "peers_left_out_of_the_run_at_end": sorted(set(peer_steps) - in_pipeline),
        "steps_lost": max(behind.values(), default=None), "steps_redone": redone,
        "steps_replayed_on_a_restarted_stage": trainer.replayed,
        "lost_steps_reported": [{k: v for k, v in lost.items() if k != "message"} for lost in trainer.lost_steps],
        "trainer_errors": len(errors), "swarm_train_would_have_stopped": bool(errors),
        "trainer_error_samples": errors[:6], "pipeline_at_end": pipeline,
        "held_out_loss": {"before": round(loss_before, 5), "after": loss_after},
        "restart_failures": chaos.restart_failures, "kill_events": public_events(kills),
        "trainer_log": tap.summary(), "peer_logs": scan_peer_logs(workdir),
    }
    if args.train_replicas == 0 and abandoned is None:
        ref_losses, ref_loss = reference(model_dir, steps)
        same = [a == b for a, b in zip(losses, ref_losses, strict=True)]
        out["one_process_without_kills"] = {
            "held_out_loss": ref_loss, "held_out_equal": loss_after == ref_loss,
            "held_out_ratio": round(loss_after / ref_loss, 6), "step_losses_equal": same.count(True),
            "first_different_step": same.index(False) + 1 if False in same else None,
        }
    else:
        out["one_process_without_kills"] = "not comparable: replicas split each step's micro-batches" \
            if args.train_replicas else f"not compared: the run was abandoned at step {abandoned}"
    out["targets"] = {"stall <= 10 s": bool(stalls) and max(stalls) <= 10.0,
                      "no committed step lost (peers' steps = trainer's)": out["steps_lost"] == 0
                      and not trainer.lost_steps,
                      "no step redone": redone == 0}
    return out
