"""Chaos: stage peers SIGKILLed and restarted while the swarm generates (``gen``) or trains (``train``).

    python benchmarks/chaos.py [--mode gen|train|both] [--peers 6] [--kill_every 15] [--duration 180] [--loops 8]
                               [--steps N] [--kill_steps A B ...] [--out FILE] [--workdir DIR]

Everything runs on this machine: a tiny Llama made locally (seeded, no download), a bootstrap peer and the stage
peers as real processes (``LocalSwarm``, 1 torch thread each), the client or trainer in this process. Each stage
peer has its own ``--identity_path`` (and ``--checkpoint_dir`` when training): a killed peer (SIGKILL to its
process group, so its p2p daemon dies too, announcing nothing) is restarted ``--restart_after`` seconds later with
the same identity, span and folders, i.e. as the same peer id. The last line on stdout is the JSON result; the
progress bar goes to stderr. Every process and the temporary folder are removed at the end, also on failure,
Ctrl-C or SIGTERM (``--workdir DIR`` keeps models, logs and checkpoints there).

**gen**: ``--peers`` stage peers cover the model at least twice (``peers // 2`` spans, peer i serves span
i mod spans). One ``SwarmClient`` runs ``--loops`` generation loops at once; each loop runs greedy sessions one
after the other (8-token prompt from a pool of 16, 32 new tokens, through ``client.inference_session``, the
same steps as ``generate_stream``) and compares every finished session's tokens with the same generation by the
whole model in this process (``LocalModel.generate_greedy``). After ``--kill_every`` seconds without kills (the
*control* period), every ``--kill_every`` seconds the killer SIGKILLs a random stage peer among those whose span
keeps another serving replica (so no span is ever left without one); a kill with no such peer is skipped.
``--victims busy`` picks among those that hold sessions at that moment, if any do (random kills often hit an
idle replica, since sessions follow the lowest-latency chain).

*Time lost per kill* is measured per session step (one token; a session's first step also opens the chain and
runs the prompt): tau is the median step time of the whole run (first steps have their own median). A step is
*stalled* if it took more than 3 tau + 50 ms; its excess (duration - tau) is attributed to the first kill that
happened during the step, or else to the last kill before it started. Stalled steps before the first kill are
reported as the control (this machine's noise; its worst session's excess compares with a kill's time lost,
though the control lasts one kill period only); a warm-up before the control, until every loop has finished a
session (so opened its streams), is left out. A session's loss for a kill is the sum of its attributed excesses,
and **a kill's time lost is that of its worst-hit session** (what a user of that session saw); the median and
max over kills are reported, over all kills and over the kills whose victim held sessions at that moment (the
target is judged on the latter). The
same sums restricted to steps during which the session replaced a peer (``InferenceSession.recoveries`` grew)
are reported as ``failover_s``: the cost of detection, re-routing and replay alone, without e.g. the CPU that a
restarting peer takes from the others. A session fails if generation raises; sessions still running 120 s
after the end are cancelled and counted as failed.

**train**: 3 stages (blocks 0:2, 2:4, 4:6 of a 6-block model; ``--train_replicas R`` adds R replicas of 2:4,
averaged every ``--average_every`` steps), every peer with ``--checkpoint_dir`` and ``--trainers`` naming the
trainer's peer id (``LocalSwarm(train=True)``: training is opt-in for peers); ``SwarmTrainer`` as ``swarm
train`` sets it up (``checkpoint_every`` 1 by default, request timeout 60 s, rechoose_every 30 s, waiting up
to 60 s for a span's peer) runs ``--steps`` steps of 4 micro-batches of 4 x 64 tokens, 4 in flight. During the step
after each step in ``--kill_steps`` one stage peer is SIGKILLed, alternately half a median step in (mid-step) and
after the step's last backward, before its commit (``phase``); the victims, in turn: the 2:4 peer, the 4:6 peer,
2:4's replicas if any, the 0:2 peer. A step that raises (e.g. ``NoPipelineError`` when a lone stage stays down
longer than that: ``swarm train`` would stop there, and say so) is retried here
with the same micro-batches after 1 s, for up to 180 s, and counted in ``trainer_errors``. *Stall* of a kill:
the longest gap between consecutive committed steps, among the steps committed from the kill to the next kill,
minus the median gap. *Steps lost*: each peer's step count (its checkpoint's) against the trainer's at the end
for the peers of the pipeline at the end (a restarted lone stage that lost a step stays behind; a replica
re-aligns to the run's count, so for it this shows nothing; peers the run left out are listed apart); *steps
redone*: step attempts that failed and were retried. Without replicas the final held-out loss and every step's
loss are compared with ``LocalTrainer`` (same split, same micro-batches, one process):
a swarm run without kills equals it bit for bit (``benchmarks/train.py``), so any difference is the kills'.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from peers.cli.launch import READY_PEER, LocalSwarm, SwarmProcess


@dataclass
class Slot:
    """One stage peer across its restarts: same name, span, identity and folders."""

    name: str
    span: str
    extra: list[str]
    proc: SwarmProcess | None = None
    peer_id: str = ""
    serving: bool = False  # its current process has announced its blocks
    restart_due: float | None = None
    restarts: int = 0
    kill: dict | None = None  # the kill event whose restart is under way


@dataclass
class Chaos:
    """Kills and restarts stage peers; a background thread spawns due restarts and notices when they serve."""

    swarm: LocalSwarm
    model_dir: Path
    restart_after: float
    slots: list[Slot] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    restart_failures: list[str] = field(default_factory=list)
    origin: float = 0.0  # events' at_s count from here (the start of generation or training)

    def __post_init__(self) -> None:
        self.lock, self.stopped = threading.Lock(), threading.Event()
        self.thread = threading.Thread(target=self._run, name="chaos", daemon=True)

    def add(self, name: str, span: str, extra: list[str]) -> Slot:
        identity = self.swarm.workdir / "ids" / f"{name}.id"
        self.slots.append(Slot(name, span, ["--identity_path", str(identity), *extra]))
        return self.slots[-1]

    def start(self) -> None:
        for slot in self.slots:
            slot.proc = self._spawn(slot, slot.name)
        for slot in self.slots:
            slot.peer_id, slot.serving = self.swarm.wait_ready(slot.proc)[2], True
        self.thread.start()

    def killable(self) -> list[Slot]:
        """Serving peers whose span has another serving peer."""
        with self.lock:
            serving = [s for s in self.slots if s.serving]
            return [s for s in serving if any(o is not s and o.span == s.span for o in serving)]

    def kill(self, slot: Slot, **info) -> dict:
        """SIGKILL ``slot``'s peer and its p2p daemon now; it restarts ``restart_after`` s later."""
        with self.lock:
            now = time.perf_counter()
            slot.proc.kill(signal.SIGKILL)
            event = {"at_s": round(now - self.origin, 2), "peer": slot.name, "span": slot.span,
                     "peer_id": f"...{slot.peer_id[-6:]}", **info, "_t": now}
            slot.serving, slot.restart_due, slot.kill = False, now + self.restart_after, event
            self.events.append(event)
            return event

    def stop(self) -> None:
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(10)

    def _spawn(self, slot: Slot, name: str) -> SwarmProcess:
        a, b = slot.span.split(":")
        return self.swarm.start_peer(self.model_dir, block_indices=f"{a}:{b}", extra=slot.extra, name=name, wait=False)

    def _run(self) -> None:
        while not self.stopped.wait(0.1):
            with self.lock:
                now = time.perf_counter()
                for slot in self.slots:
                    if slot.restart_due is not None and now >= slot.restart_due:
                        slot.restarts += 1
                        slot.proc, slot.restart_due = self._spawn(slot, f"{slot.name}-r{slot.restarts}"), None
                    elif slot.restart_due is None and not slot.serving and slot.proc is not None:
                        if match := READY_PEER.search(slot.proc.log()):
                            slot.serving = True
                            if match.group(3) != slot.peer_id:
                                self.restart_failures.append(f"{slot.proc.name} came back as another peer id")
                            if slot.kill is not None:
                                slot.kill["serving_again_after_s"] = round(now - slot.kill["_t"], 2)
                        elif slot.proc.popen.poll() is not None:  # the restart died: note it, try again
                            self.restart_failures.append(f"{slot.proc.name}: exit {slot.proc.popen.returncode}: "
                                                         + " | ".join(slot.proc.log().splitlines()[-3:]))
                            slot.restart_due = now + self.restart_after


class LogTap(logging.Handler):
    """Keeps this process's fusionswarm log records (bans, re-routes, retries) with their times, and writes them
    to ``path``, instead of printing them over the progress bar."""

    def __init__(self, path: Path) -> None:
        super().__init__(logging.INFO)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file, self.records = open(path, "a"), []
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        for name in ("peers", "swarm", "privacy"):
            logger = logging.getLogger(name)
            logger.handlers[:], logger.propagate = [self], False
            logger.setLevel(logging.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.records.append((time.perf_counter(), record.levelno >= logging.WARNING, message))
        self.file.write(self.format(record) + "\n")
        self.file.flush()

    def count(self, pattern: str, since: float = 0.0) -> int:
        return sum(1 for t, _, m in self.records if t >= since and re.search(pattern, m))

    def summary(self) -> dict:
        """Counts of the kinds of events, and the most frequent messages (peer ids and numbers masked)."""
        kinds = {"bans": r"^Banned peer", "sessions_replaced_a_peer": r"^Replaced peer",
                 "all_replicas_banned_waits": r"^Every peer that serves", "train_step_retries": r"retrying step",
                 "train_apply_failures": r"did not apply step", "warnings_and_errors": None}
        counts = {k: (self.count(p) if p else sum(1 for _, warn, _ in self.records if warn)) for k, p in kinds.items()}
        masked = Counter(_mask(m) for _, warn, m in self.records if warn or m.startswith(("Banned", "Every peer")))
        return {**counts, "top_messages": [f"{n} x {m}" for m, n in masked.most_common(8)]}

    def close(self) -> None:
        for name in ("peers", "swarm", "privacy"):
            logging.getLogger(name).removeHandler(self)
        self.file.close()
        super().close()


def _mask(message: str) -> str:
    message = re.sub(r"\.\.\.\w{6}|12D3KooW\w+|Qm\w{44}", "...", message)
    message = re.sub(r"\b\d+(\.\d+)?\b", "N", message)
    return message[:200]


def scan_peer_logs(workdir: Path) -> dict:
    """Warnings, errors and tracebacks in the peers' logs, counted by (masked) message."""
    found: Counter[str] = Counter()
    for log in sorted((workdir / "logs").glob("*.log")):
        if log.stem in ("client", "trainer"):  # this process's own log: summarised by LogTap
            continue
        lines = log.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if line.startswith("Traceback"):  # named by the exception that ends it
                end = next((x for x in lines[i + 1:] if x and not x.startswith(" ")), "?")
                found[f"{log.stem.split('-r')[0]}: traceback ending in {_mask(end)}"] += 1
            elif re.search(r" (WARN|WARNING|ERROR|CRITICAL) ", line):
                found[f"{log.stem.split('-r')[0]}: {_mask(line.split(': ', 1)[-1])}"] += 1
    return {"warning_or_error_lines": sum(found.values()), "top": [f"{n} x {m}" for m, n in found.most_common(10)]}


def public_events(events: list[dict]) -> list[dict]:
    return [{k: v for k, v in e.items() if not k.startswith("_")} for e in events]


def progress_bar() -> Progress:
    return Progress(console=Console(stderr=True), transient=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["gen", "train", "both"], default="gen")
    parser.add_argument("--peers", type=int, default=6, help="gen: stage peers (they cover the model >= twice)")
    parser.add_argument("--loops", type=int, default=8, help="gen: concurrent generation loops in the client")
    parser.add_argument("--kill_every", type=float, default=15.0, help="gen: seconds between kills")
    parser.add_argument("--duration", type=float, default=180.0, help="gen: seconds of generation (control included)")
    parser.add_argument("--victims", choices=["random", "busy"], default="random",
                        help="gen: any killable peer, or one that holds sessions (when one does)")
    parser.add_argument("--restart_after", type=float, default=3.0, help="seconds from a kill to the restart")
    parser.add_argument("--update_period", type=float, default=2.0, help="peers' announcement period, seconds")
    parser.add_argument("--steps", type=int, default=300, help="train: optimizer steps")
    parser.add_argument("--kill_steps", type=int, nargs="*", default=None,
                        help="train: kill a stage peer during the step after each of these (default: 1/4, 1/2, 3/4)")
    parser.add_argument("--train_replicas", type=int, default=0, help="train: extra replicas of the 2:4 stage")
    parser.add_argument("--average_every", type=int, default=4, help="train, with replicas: averaging period")
    parser.add_argument("--checkpoint_every", type=int, default=1, help="train: peers save every N steps")
    parser.add_argument("--seed", type=int, default=0, help="the killer's choices")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here (indented)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep models, logs, checkpoints here")
    args = parser.parse_args()
    if args.peers < 2 or args.loops < 1 or args.kill_every <= 0 or args.duration <= args.kill_every:
        parser.error("need --peers >= 2, --loops >= 1 and --duration > --kill_every > 0")
    if args.steps < 4:
        parser.error("--steps must be >= 4")

    def interrupt(signum, frame):  # SIGTERM, and SIGINT even where a shell ignores it, clean up like Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    import torch

    torch.set_num_threads(1)  # like every peer: they all share this machine's cores
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "peers", "swarm", "privacy"],
                           capture_output=True, text=True, cwd=Path(__file__).parent.parent).stdout.strip()
    result: dict = {"benchmark": "chaos", "commit": commit + ("+local changes" if dirty else ""),
                    "machine": f"{platform.machine()}, {os.cpu_count()} cores", "argv": sys.argv[1:]}
    sys.modules.setdefault("chaos", sys.modules[__name__])  # the helpers import this module: not a second copy
    root = args.workdir or Path(tempfile.mkdtemp(prefix="fusionswarm-chaos-"))
    try:
        if args.mode in ("gen", "both"):
            from chaos_gen import run_gen

            result["gen"] = run_gen(args, root / "gen")
        if args.mode in ("train", "both"):
            from chaos_train import run_train

            result["train"] = run_train(args, root / "train")
    except KeyboardInterrupt:
        print("interrupted: every process was stopped", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
