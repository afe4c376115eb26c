"""Generation under chaos (``python benchmarks/chaos.py --mode gen``): the method is in chaos.py's docstring."""

from __future__ import annotations

import asyncio
import bisect
import itertools
import random
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from chaos import Chaos, LogTap, progress_bar, public_events, scan_peer_logs

from peers.cli.launch import LocalSwarm
from peers.client.inference_session import InferenceSession
from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig
from peers.model import LocalModel, make_tiny_model

MODEL = dict(family="llama", hidden_size=64, num_layers=8, num_heads=4, num_kv_heads=2, intermediate_size=128)
PROMPT, NEW, POOL = 8, 32, 16
STALL_FACTOR, STALL_MIN = 3.0, 0.05  # a step is stalled above STALL_FACTOR * tau + STALL_MIN seconds
DRAIN = 120.0  # seconds sessions may still run after --duration before they are cancelled


@dataclass
class Session:
    index: int
    loop: int
    prompt: int
    steps: list[tuple[float, float, int]] = field(default_factory=list)  # (start, end, peers replaced)
    tokens: list[int] = field(default_factory=list)
    error: str | None = None
    done: bool = False
    live: InferenceSession | None = None


def spans(peers: int, num_layers: int) -> list[str]:
    """Peer i's span: ``peers // 2`` contiguous spans, so each is served by at least two peers."""
    count = max(1, peers // 2)
    cuts = [round(i * num_layers / count) for i in range(count + 1)]
    return [f"{cuts[i % count]}:{cuts[i % count + 1]}" for i in range(peers)]


async def one_session(client: SwarmClient, record: Session, prompt: torch.Tensor) -> None:
    """Greedy generation with the steps of ``generate_stream``, timing each step and noting its re-routes."""
    t = time.perf_counter()  # the first step also opens the chain
    async with client.inference_session(max_length=PROMPT + NEW) as session:
        record.live = session
        tokens, position = prompt, 0
        for _ in range(NEW):
            positions = torch.arange(position, position + tokens.shape[1]).expand_as(tokens)
            with torch.inference_mode():
                hidden = client.embedding(tokens, positions)
            before = session.recoveries
            out = await session.step(hidden)
            with torch.inference_mode():
                chosen = client.head(out[:, -1:].to(client.device, client.dtype))[:, -1].argmax(-1)
            position += tokens.shape[1]
            now = time.perf_counter()
            record.steps.append((t, now, session.recoveries - before))
            record.tokens.append(int(chosen[0]))
            tokens, t = chosen[:, None], now
    record.live, record.done = None, True


async def generation_loops(client: SwarmClient, loops: int, prompts: list[torch.Tensor], sessions: list[Session],
                           stop: threading.Event) -> None:
    counter = itertools.count()

    async def loop(index: int) -> None:
        while not stop.is_set():
            number = next(counter)
            record = Session(number, index, number % len(prompts))
            sessions.append(record)
            t = time.perf_counter()
            try:
                await one_session(client, record, prompts[record.prompt])
            except Exception as e:  # a failed session: note it, go on with the next one
                record.error, record.live = f"{type(e).__name__}: {e}"[:300], None
                start = record.steps[-1][1] if record.steps else t
                record.steps.append((start, time.perf_counter(), 0))  # the step that failed
                await asyncio.sleep(0.5)

    await asyncio.gather(*(loop(i) for i in range(loops)))


def time_lost(sessions: list[Session], kills: list[dict], t0: float) -> dict:
    """Stalled steps' excess time per kill and session (chaos.py's docstring); fills each kill's figures. Steps
    that started before ``t0`` (the warm-up) are left out."""
    firsts = [s.steps[0][1] - s.steps[0][0] for s in sessions if s.steps and s.steps[0][0] >= t0]
    rest = [b - a for s in sessions for a, b, _ in s.steps[1:] if a >= t0]
    tau_first, tau = statistics.median(firsts), statistics.median(rest)
    times = [k["_t"] for k in kills]
    lost = [dict() for _ in kills]  # session index -> excess seconds
    failover = [dict() for _ in kills]
    control = {"stalled_steps": 0, "excess_s": 0.0, "steps": 0}
    quiet: dict[int, float] = {}  # session index -> excess of its stalled steps before the first kill
    for s in sessions:
        for i, (a, b, replaced) in enumerate(s.steps):
            if a < t0:
                continue
            typical = tau_first if i == 0 else tau
            k = bisect.bisect_left(times, a)  # the first kill during the step, else the last one before it
            k = k if k < len(times) and times[k] <= b else k - 1
            if k < 0:
                control["steps"] += 1
            stalled = b - a > STALL_FACTOR * typical + STALL_MIN
            if not stalled and not replaced:
                continue
            excess = max(0.0, b - a - typical)
            if k < 0:
                control["stalled_steps"] += stalled
                control["excess_s"] += excess if stalled else 0.0
                quiet[s.index] = quiet.get(s.index, 0.0) + (excess if stalled else 0.0)
                continue
            if stalled:
                lost[k][s.index] = lost[k].get(s.index, 0.0) + excess
            if replaced:
                failover[k][s.index] = failover[k].get(s.index, 0.0) + excess
    for kill, per_session, per_failover in zip(kills, lost, failover, strict=True):
        kill["time_lost_s"] = round(max(per_session.values(), default=0.0), 3)
        kill["failover_s"] = round(max(per_failover.values(), default=0.0), 3)
        kill["sessions_slowed"] = len(per_session)
        kill["session_seconds_lost"] = round(sum(per_session.values()), 3)

    def stats(key: str, which: list[dict]) -> dict:
        values = [k[key] for k in which]
        return {"median": round(statistics.median(values), 3), "max": round(max(values), 3), "kills": len(values)} \
            if values else {"median": None, "max": None, "kills": 0}

    hit = [k for k in kills if k["sessions_on_victim"] > 0]
    control["excess_s"] = round(control["excess_s"], 3)
    control["worst_session_excess_s"] = round(max(quiet.values(), default=0.0), 3)  # compare with a kill's
    return {
        "tau_step_s": round(tau, 4), "tau_first_step_s": round(tau_first, 4),
        "time_lost_per_kill_s": stats("time_lost_s", kills),
        "time_lost_per_kill_victim_held_sessions_s": stats("time_lost_s", hit),
        "failover_per_kill_s": stats("failover_s", kills),
        "failover_per_kill_victim_held_sessions_s": stats("failover_s", hit),
        "control_before_first_kill": control,
    }


def run_gen(args, workdir: Path) -> dict:
    rng = random.Random(args.seed)
    model_dir = make_tiny_model(workdir / "llama-chaos", seed=0, **MODEL)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (1, PROMPT), generator=gen) for _ in range(POOL)]
    local = LocalModel.from_dir(model_dir)
    expected = [local.generate_greedy(p, NEW)[0, PROMPT:].tolist() for p in prompts]
    tap = LogTap(workdir / "logs" / "client.log")
    sessions: list[Session] = []
    skipped: list[float] = []
    try:
        with LocalSwarm(workdir, update_period=args.update_period) as swarm, progress_bar() as progress:
            swarm.start_dht()
            chaos = Chaos(swarm, model_dir, args.restart_after)
            for i, span in enumerate(spans(args.peers, MODEL["num_layers"])):
                chaos.add(f"stage{i}", span, [])
            chaos.start()
            try:
                with SwarmClient(model_dir, config=ClientConfig(swarm=swarm.swarm_config())) as client:
                    client.wait_for_records(args.peers)
                    stop = threading.Event()
                    warm_up = time.perf_counter()
                    future = asyncio.run_coroutine_threadsafe(
                        generation_loops(client, args.loops, prompts, sessions, stop), client.loop.loop)
                    while len({s.loop for s in sessions if s.done}) < args.loops and not future.done() \
                            and time.perf_counter() < warm_up + 60:  # every loop opened its streams
                        time.sleep(0.1)
                    t0 = chaos.origin = time.perf_counter()
                    task = progress.add_task("chaos: generation", total=args.duration)
                    next_kill = t0 + args.kill_every
                    while (now := time.perf_counter()) < t0 + args.duration and not future.done():
                        if now >= next_kill:
                            next_kill += args.kill_every
                            victims = chaos.killable()
                            live = [s.live for s in list(sessions) if s.live is not None]
                            holding = {v.name: sum(v.peer_id in {h.peer_id for h in list(x.hops)} for x in live)
                                       for v in victims}
                            if args.victims == "busy" and any(holding.values()):
                                victims = [v for v in victims if holding[v.name]]
                            if victims:
                                victim = rng.choice(victims)
                                chaos.kill(victim, sessions_on_victim=holding[victim.name])
                            else:
                                skipped.append(round(now - t0, 1))
                        done = sum(s.done for s in sessions)
                        progress.update(task, completed=now - t0, description=(
                            f"chaos: {len(chaos.events)} kills, {done} sessions done, "
                            f"{sum(s.error is not None for s in sessions)} failed"))
                        time.sleep(0.1)
                    stop.set()
                    progress.update(task, description="chaos: sessions in flight finishing")
                    try:
                        future.result(DRAIN)
                    except TimeoutError:
                        future.cancel()
                    t_end = time.perf_counter()
                    time.sleep(0.5)
            finally:
                chaos.stop()
            restarts_serving = sum(1 for e in chaos.events if "serving_again_after_s" in e)
    finally:
        tap.close()
    for s in sessions:
        if not s.done and s.error is None:
            s.error = f"still running {DRAIN:.0f} s after the end: cancelled"
    finished = [s for s in sessions if s.done]
    failed = [s for s in sessions if s.error is not None]
    kills = chaos.events
    lost = time_lost(sessions, kills, t0)
    equal = [s.tokens == expected[s.prompt] for s in finished]
    prefix_ok = [s.tokens == expected[s.prompt][:len(s.tokens)] for s in failed]
    first_kill = kills[0]["_t"] if kills else t_end
    token_times = [b for s in sessions for _, b, _ in s.steps[:len(s.tokens)]]
    tokens_before = sum(1 for b in token_times if t0 <= b < first_kill)
    tokens_after = sum(1 for b in token_times if b >= first_kill)
    ready = [e["serving_again_after_s"] for e in kills if "serving_again_after_s" in e]
    targets_lost = lost["time_lost_per_kill_victim_held_sessions_s"]
    return {
        "model": {**MODEL, "dtype": "float32"}, "prompt_tokens": PROMPT, "new_tokens": NEW,
        "peers": args.peers, "victims": args.victims, "spans": sorted(set(spans(args.peers, MODEL["num_layers"]))),
        "loops": args.loops,
        "kill_every_s": args.kill_every, "duration_s": args.duration, "warm_up_s": round(t0 - warm_up, 2),
        "restart_after_s": args.restart_after, "update_period_s": args.update_period,
        "sessions": {"started": len(sessions), "finished": len(finished), "failed": len(failed)},
        "tokens_equal_one_process": all(equal) and bool(equal),
        "finished_sessions_with_other_tokens": equal.count(False),
        "failed_sessions_partial_tokens_equal": prefix_ok.count(True),
        "failure_reasons": sorted({s.error for s in failed})[:8],
        "kills": len(kills), "kills_skipped_no_replica_left": skipped,
        "kills_whose_victim_held_sessions": sum(1 for k in kills if k["sessions_on_victim"] > 0),
        "restarted_and_serving": restarts_serving, "restart_failures": chaos.restart_failures,
        "restart_serving_after_kill_s": {"median": round(statistics.median(ready), 2) if ready else None,
                                         "max": max(ready, default=None)},
        **lost,
        "tokens_per_s": {"before_first_kill": round(tokens_before / max(first_kill - t0, 1e-9), 1),
                         "after_first_kill": round(tokens_after / max(t_end - first_kill, 1e-9), 1)},
        "client_log": tap.summary(), "peer_logs": scan_peer_logs(workdir),
        "kill_events": public_events(kills),
        "targets": {
            "0 failed sessions": not failed,
            "all outputs equal one process": all(equal) and not failed,
            "time lost per kill median <= 1.5 s": targets_lost["median"] is not None and targets_lost["median"] <= 1.5,
            "time lost per kill max <= 5 s": targets_lost["max"] is not None and targets_lost["max"] <= 5.0,
        },
    }
