"""Our plan against two baselines on the testbed: training tokens/s of the same peers arranged four ways.

    sudo python benchmarks/plan_testbed.py [--matrices three_sites,homes]
                                           [--arrangements random,least_served,plan,plan_live]
                                           [--steps 20] [--repeats 3] [--seed 0] [--no_churn] [--quick] [--out FILE]

A testbed (``swarm.testbed``, root needed) of 12 hosts: h0 the bootstrap peer, h1 the trainer
(benchmarks/plan_testbed_worker.py), h2..h11 ten stage peers of a tiny Llama (hidden 64, 9 blocks, fp32; one torch
thread each: a block's compute is small beside an activation of 64 floats per token on a slow link, even on
this 2-core machine) whose memory holds
``MAX_BLOCKS`` blocks (3, 5 or 9: ``--max_blocks``). Matrices: ``three_sites`` (h0-h3 site a, h4-h7 site b, h8-h11
site c: 10 Gbit/s inside a site, 100 Mbit/s between a and b, 8 Mbit/s to c) and ``homes`` (every host on its own
home line: uploads of 10-200 Mbit/s, ``HOMES_UP``, downloads 5x that up to 200 Mbit/s). No latency (this kernel has
no netem). Each arrangement starts its own ten peers (fresh identities, the same hosts and memory), trains
``--steps`` steps of 4 micro-batches of 8 x 64 tokens, 4 in flight, chain data path, from the same step-0
checkpoint, then stops them; with ``--repeats`` the arrangements are interleaved:

* ``random``: the peers shuffled (seeded) into groups of three, each group cut at random points (each stage within
  its peer's memory), the leftover peer on a random span; the trainer trains on the first group.
* ``least_served``: today's rule with equal cuts: each peer in turn takes the least-served window of 3 blocks (a
  third; ``swarm.block_selection.choose_blocks`` on the spans of the peers before it, as ``--num_blocks 3`` does when
  peers start one after the other; here they then start at once with those spans); the trainer picks its stages as
  today (``swarm.stages``: whole spans tiling the blocks, every replica of a span sharing the micro-batches).
* ``plan`` (static): the planner (``swarm.plan.make_plan``) on the peers' compute (one block timed on this machine,
  best of 5 rounds: every host shares its CPUs), their memory and the configured link rates; peers started with
  the planned spans (backups on a span of their own, unused); the trainer trains on the plan's group the estimator
  prices fastest for the trainer's links.
* ``plan_live``: the live path: peers start on the least-served spans with ``--max_blocks``, probe their links
  (up to ``PROBE_WAIT_S``), and the trainer is its run's broker (``SwarmTrainer(plan=True)``): it plans from the
  swarm's records, publishes, the peers move, it trains on the group it prices fastest. In the last ``plan_live``
  run on ``three_sites`` (unless ``--no_churn``), after the timed steps: one stage peer of that group is SIGKILLed
  (steps lost, seconds until the next step ends, the plan that replaced it), then a new peer (memory for every
  block) joins as a backup in the trainer's host, and the run is planned again: its place in the next plan.

Reported: each arrangement's tokens/s (the trainer's, after the first step, which opens the run), the estimator's
figure for the pipelines that have one (configured rates, the compute timed here; each host with its own cores, and
every host sharing this machine's cores), and the ratios plan/random, plan/least_served, plan/bound; and, as a check
on the luck of the random draws run (each repeat draws anew), the estimator's median, p10 and p90 over
``RANDOM_DRAWS`` other draws of ``random`` (priced, not run) and plan over a median draw. Every namespace
and process is removed at the end (the ``Testbed`` context manager), also on failure. Prints JSON and writes it to
``--out`` (not with ``--quick``: a check that it works, for tests: three_sites, the ``plan`` arrangement only unless
``--arrangements`` says otherwise, 2 steps, no churn, only the peers the run trains on started).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import secrets
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import estimator_calibration as calibration  # noqa: E402
from estimator import OnTestbed, links_of  # noqa: E402
from report import report  # noqa: E402
from rich.console import Console  # noqa: E402
from train import write_initial_state  # noqa: E402

from peers.cli.launch import LocalSwarm, SwarmProcess  # noqa: E402
from peers.model import ModelConfig, make_tiny_model  # noqa: E402
from peers.server.block_timing import compute_key  # noqa: E402
from peers.training import OptimConfig  # noqa: E402
from privacy.identity import Identity  # noqa: E402
from privacy.peer_ids import peer_id_of  # noqa: E402
from swarm.block_selection import choose_blocks  # noqa: E402
from swarm.estimator import CLIENT, ClientCompute, Compute, ModelShape, Pipeline, Stage, estimate_training  # noqa: E402
from swarm.measure import Compute as MeasuredCompute  # noqa: E402
from swarm.measure import cached_compute  # noqa: E402
from swarm.records import PeerRecord, PeerState  # noqa: E402
from swarm.testbed import Testbed, require_root  # noqa: E402
from swarm.testbed.cleanup import leftovers, nothing_left  # noqa: E402
from swarm.testbed.matrices import MATRICES, MBIT, Matrix  # noqa: E402

MODEL = dict(family="llama", hidden_size=64, num_layers=9, num_heads=4, num_kv_heads=2, intermediate_size=128)
BLOCKS = MODEL["num_layers"]
HOSTS, DHT_HOST, TRAINER_HOST = 12, 0, 1
PEER_HOSTS = tuple(range(2, HOSTS))
MAX_BLOCKS = dict(zip(PEER_HOSTS, (9, 3, 5, 3, 5, 3, 9, 5, 9, 3), strict=True))  # blocks each peer's memory holds
HOMES_UP = (100, 50, 10, 200, 20, 100, 10, 50, 200, 20, 100, 10)  # Mbit/s upload of h0..h11 (down: 5x, <= 200)
ARRANGEMENTS = ("random", "least_served", "plan", "plan_live")
READY_BACKUP = re.compile(r"Backup peer (\w+) of \S+ ready")
PROBE_LINE = re.compile(r"\(probe\)")
PROBE_WAIT_S = 100.0  # live plan: seconds at most for the peers' link probes before the trainer plans
CHURN = dict(after_kill=3, after_join=2, join_wait=90, join_links=5)
TRAIN = dict(accumulation=4, micro_batch=8, seq_len=64, in_flight=4, seed=0)
GROUP_SIZE = 3  # peers per random group
RANDOM_DRAWS, RANDOM_DRAW_SEED = 500, 100_000  # random arrangements priced by the estimator (not run)
console = Console(stderr=True)


def say(text: str) -> None:
    console.print(text, markup=False, highlight=False)


def homes() -> Matrix:
    """Every host on a home line of its own: the upload of ``HOMES_UP``, a download of 5x that (at most 200)."""
    return Matrix("homes", "every host on its own home line: upload 10-200 Mbit/s (h0..h11: "
                  f"{', '.join(map(str, HOMES_UP))}), download 5x the upload up to 200 Mbit/s",
                  up=lambda i, n: HOMES_UP[i] * MBIT, down=lambda i, n: min(200, 5 * HOMES_UP[i]) * MBIT,
                  site=lambda i, n: f"home{i}")


MATRIX_CHOICES = {"three_sites": MATRICES["three_sites"], "homes": homes()}


def optim(steps: int) -> dict:
    return {"lr": 3e-3, "warmup_steps": 1, "schedule": "cosine", "total_steps": steps, "clip_norm": 1.0,
            "weight_decay": 0.01}


# ---- arrangements: which blocks each peer host serves ------------------------------------------------------------
Layout = dict[int, str]  # peer host -> its --block_indices START:END


def random_layout(rng: random.Random) -> tuple[Layout, list[int]]:
    """Random groups of ``GROUP_SIZE`` peers, each cut at random points within its peers' memory; the leftover on a
    random span. Returns the layout and the first group's hosts (in pipeline order)."""
    hosts = list(PEER_HOSTS)
    rng.shuffle(hosts)
    layout: Layout = {}
    groups = [hosts[i:i + GROUP_SIZE] for i in range(0, len(hosts) - len(hosts) % GROUP_SIZE, GROUP_SIZE)]
    for group in groups:
        for _ in range(10_000):
            cuts = [0, *sorted(rng.sample(range(1, BLOCKS), len(group) - 1)), BLOCKS]
            if all(cuts[k + 1] - cuts[k] <= MAX_BLOCKS[h] for k, h in enumerate(group)):
                break
        else:
            raise RuntimeError(f"no random cuts fit the memory of hosts {group}")
        for k, h in enumerate(group):
            layout[h] = f"{cuts[k]}:{cuts[k + 1]}"
    for h in hosts[len(groups) * GROUP_SIZE:]:
        size = rng.randint(1, MAX_BLOCKS[h])
        start = rng.randint(0, BLOCKS - size)
        layout[h] = f"{start}:{start + size}"
    return layout, groups[0]


def least_served_layout(ids: dict[int, str]) -> Layout:
    """Today's rule: each peer in turn takes the least-served window of a third of the blocks
    (``swarm.block_selection.choose_blocks`` on the records of the peers before it; every peer here measures the
    same throughput, as they share this machine and its measurement cache)."""
    records: list[PeerRecord] = []
    for h in PEER_HOSTS:
        start, end = choose_blocks(records, BLOCKS, min(BLOCKS // 3, MAX_BLOCKS[h]))
        records.append(PeerRecord(ids[h], "plan-testbed", start, end, PeerState.ONLINE, throughput=1.0))
    return {h: f"{r.start}:{r.end}" for h, r in zip(PEER_HOSTS, records, strict=True)}


def static_plan(ids: dict[int, str], block: Compute, tb: Testbed) -> tuple[object, Layout]:
    """The planner on the peers' compute, memory and the configured links; each peer's span (backups: 0:N)."""
    from swarm.plan import PlanPeer, make_plan  # the planner branch

    host_of = {peer: tb.hosts[h] for h, peer in ids.items()}
    peers = [PlanPeer(ids[h], block.forward_s, block.backward_s, MAX_BLOCKS[h]) for h in PEER_HOSTS]

    def links(a: str, b: str) -> tuple[float, float]:
        rate = tb.rate(host_of[a], host_of[b])
        return (rate if rate != float("inf") else 1e13), 0.0

    plan = make_plan(peers, BLOCKS, links, shape=shape(), objective="training", model="plan-testbed", version=1,
                     broker="", now=time.time())
    layout: Layout = {}
    for h, peer in ids.items():
        place = plan.place_of(peer)
        layout[h] = f"{place.start}:{place.end}" if place else f"0:{min(MAX_BLOCKS[h], BLOCKS // 3)}"
    return plan, layout


def shape() -> ModelShape:
    return ModelShape(hidden_size=MODEL["hidden_size"], num_blocks=BLOCKS, dtype_bytes=4)


def estimate(spans: list[tuple[str, int, int]], hosts: dict, place: OnTestbed, block: Compute,
             client: ClientCompute, cores: int | None) -> float:
    """The estimator's tokens/s for the pipeline ``spans`` (peer, start, end) trained from the trainer's host."""
    stages = tuple(Stage(peer, start, end, block) for peer, start, end in spans)
    pipeline = Pipeline(stages, links_of(place, {CLIENT: hosts[CLIENT], **{p: hosts[p] for p, _, _ in spans}}),
                        client=client, topology="chain")
    return estimate_training(shape(), pipeline, rows=TRAIN["micro_batch"], seq_len=TRAIN["seq_len"],
                             micro_batches=TRAIN["accumulation"], in_flight=TRAIN["in_flight"],
                             cores=cores).tokens_per_s


# ---- one arrangement ---------------------------------------------------------------------------------------------
def identities(folder: Path) -> tuple[dict[int, str], dict[int, Path]]:
    """A fresh identity per peer host: its peer id is known before the peer starts."""
    paths = {h: folder / f"h{h}.id" for h in PEER_HOSTS}
    return {h: peer_id_of(Identity.load_or_create(p).public_bytes) for h, p in paths.items()}, paths


def start_peers(swarm: LocalSwarm, tb: Testbed, model_dir: Path, layout: Layout, paths: dict[int, Path],
                checkpoint_dir: Path, tag: str, hosts: list[int]) -> list[SwarmProcess]:
    """One peer on each of ``hosts`` with its span in ``layout``, all at once."""
    procs = []
    for h in hosts:
        proc = swarm.start_peer(model_dir, block_indices=layout[h], wait=False, name=f"{tag}-h{h}", host=tb.hosts[h],
                                extra=["--checkpoint_dir", str(checkpoint_dir), "--identity_path", str(paths[h]),
                                       "--max_blocks", str(MAX_BLOCKS[h])])
        proc.host = h
        procs.append(proc)
    for proc in procs:
        swarm.wait_ready(proc, timeout=300)
    return procs


def stop_peers(swarm: LocalSwarm, procs: list[SwarmProcess]) -> None:
    """SIGTERM to all at once (each leaves the swarm cleanly), then whatever is left of each group is killed."""
    for proc in procs:
        if proc.popen.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for proc in procs:
        proc.stop(timeout=15)
        swarm.processes.remove(proc)


def wait_for_probes(procs: list[SwarmProcess]) -> tuple[float, int]:
    """Until every peer has probed most of the others (or ``PROBE_WAIT_S``): the planner needs measured links."""
    t0 = time.monotonic()
    while True:
        counts = [len(PROBE_LINE.findall(p.log())) for p in procs]
        if min(counts) >= len(procs) - 2 or time.monotonic() - t0 > PROBE_WAIT_S:
            return round(time.monotonic() - t0, 1), sum(counts)
        time.sleep(2.0)


def start_joiner(swarm: LocalSwarm, tb: Testbed, model_dir: Path, workdir: Path, tag: str, spec: dict
                 ) -> SwarmProcess:
    """A new fast peer (memory for every block) in the trainer's host, as a backup; its id goes to the worker."""
    path = workdir / "ids" / tag / "joiner.id"
    Identity.load_or_create(path)
    proc = swarm.start_peer(model_dir, wait=False, name=f"{tag}-joiner", host=tb.hosts[TRAINER_HOST],
                            extra=["--backup", "--max_blocks", str(BLOCKS), "--identity_path", str(path),
                                   "--checkpoint_dir", str(workdir / "checkpoints")])
    proc.peer_id = proc.wait_for(READY_BACKUP, 300).group(1)
    Path(spec["churn"]["join_id"]).write_text(proc.peer_id)
    say(f"[{tag}] a new peer joined in the trainer's host h{TRAINER_HOST}: {proc.peer_id[-8:]}")
    return proc


def named(value, names: dict[str, str]):
    """``value`` with every peer id replaced by its host's name (``h3``), so the JSON reads by host."""
    if isinstance(value, str):
        return names.get(value, value)
    if isinstance(value, list):
        return [named(v, names) for v in value]
    if isinstance(value, dict):
        return {named(k, names): named(v, names) for k, v in value.items()}
    return value


def run_arrangement(name: str, rep: int, ctx: dict) -> dict:
    tb, swarm, workdir = ctx["tb"], ctx["swarm"], ctx["workdir"]
    tag = f"{ctx['matrix']}-{name}-{rep}"
    ids, paths = identities(workdir / "ids" / tag)
    out: dict = {}
    if name == "random":
        layout, first = random_layout(random.Random(ctx["seed"] * 1000 + rep))
        allowed = [ids[h] for h in first]
        spans = [(ids[h], *map(int, layout[h].split(":"))) for h in first]
        out["pipeline"] = [f"h{h}:{layout[h]}" for h in first]
    elif name == "least_served":
        layout, allowed, spans = least_served_layout(ids), list(ids.values()), []
    elif name == "plan_live":
        layout, allowed, spans = least_served_layout(ids), [], []
    else:
        plan, layout = static_plan(ids, ctx["block"], tb)
        host_of = {peer: h for h, peer in ids.items()}
        groups = [[(s.peer_id, s.start, s.end) for s in g.stages] for g in plan.groups]
        bounds = [estimate(g, ctx["hosts_of"](ids), ctx["place"], ctx["block"], ctx["client"], None) for g in groups]
        best = max(range(len(groups)), key=lambda i: bounds[i])
        spans = groups[best]
        allowed = [p for p, _, _ in spans]
        out["plan"] = {"groups": [{"stages": [f"h{host_of[p]}:{a}:{b}" for p, a, b in g],
                                   "planner_tokens_per_s": round(plan.groups[i].tokens_per_s, 1),
                                   "estimated_tokens_per_s": round(bounds[i], 1)} for i, g in enumerate(groups)],
                       "backups": [f"h{host_of[p]}" for p in plan.backups], "trained_group": best}
        out["pipeline"] = [f"h{host_of[p]}:{a}:{b}" for p, a, b in spans]
    if spans:
        hosts = ctx["hosts_of"](ids)
        out["estimated_tokens_per_s"] = round(estimate(spans, hosts, ctx["place"], ctx["block"], ctx["client"],
                                                       None), 1)
        out["estimated_tokens_per_s_shared_cores"] = round(estimate(spans, hosts, ctx["place"], ctx["block"],
                                                                    ctx["client"], os.cpu_count()), 1)
    run_id = f"{tag}-{secrets.token_hex(3)}"
    write_initial_state(ctx["model_dir"], workdir / "checkpoints", run_id,
                        sorted({(int(b.split(":")[0]), int(b.split(":")[1])) for b in layout.values()}),
                        OptimConfig(**optim(ctx["steps"])))
    t0 = time.perf_counter()
    # --quick: only the peers the run trains on (the check is that it runs; the others would only be started)
    started = [h for h in PEER_HOSTS if not (ctx["quick"] and allowed) or ids[h] in allowed]
    procs = start_peers(swarm, tb, ctx["model_dir"], layout, paths, workdir / "checkpoints", tag, started)
    out["served"] = {f"h{p.host}": "{}:{}".format(*p.blocks) for p in procs}
    out["peers_start_s"] = round(time.perf_counter() - t0, 1)
    joiner: list[SwarmProcess] = []
    try:
        spec = {"model_dir": str(ctx["model_dir"]), "initial_peers": swarm.initial_peers,
                "address": tb.hosts[TRAINER_HOST].address, "identity_path": str(swarm.trainer_identity()),
                "allowed": allowed, "wait_records": len(allowed) or len(procs), "run_id": run_id,
                "train": {**TRAIN, "steps": ctx["steps"], "optim": optim(ctx["steps"])}}
        spec_path, out_path = workdir / f"{tag}.spec.json", workdir / f"{tag}.out.json"
        if name == "plan_live":
            out["probe_wait_s"], out["probes"] = wait_for_probes(procs)
            spec["plan"] = True
            if ctx["churn"] and rep == ctx["repeats"] - 1:
                spec["churn"] = {**CHURN, "pids": {ids[p.host]: p.pid for p in procs},
                                 "join_request": str(workdir / f"{tag}.join"),
                                 "join_id": str(workdir / f"{tag}.joined")}
        spec_path.write_text(json.dumps(spec))
        worker = tb.spawn(tb.hosts[TRAINER_HOST], [sys.executable, str(HERE / "plan_testbed_worker.py"),
                                                   str(spec_path), str(out_path)], name=f"{tag}-trainer")
        try:
            deadline = time.monotonic() + 1200
            while worker.poll() is None and time.monotonic() < deadline:
                if "churn" in spec and not joiner and Path(spec["churn"]["join_request"]).exists():
                    joiner.append(start_joiner(swarm, tb, ctx["model_dir"], workdir, tag, spec))
                time.sleep(0.5)
        finally:
            if worker.poll() is None:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait(5)
        if worker.returncode != 0 or not out_path.exists():
            raise RuntimeError(f"the trainer of {tag} failed (exit {worker.returncode}):\n"
                               f"{worker.log_path.read_text(errors='replace')[-4000:]}")
        measured = json.loads(out_path.read_text())
    finally:
        stop_peers(swarm, procs + joiner)
    host_of = {peer: h for h, peer in ids.items()}
    if name == "plan_live":  # the estimator's figure for the group the run's own plan trained on
        trained = [(p, a, b) for p, a, b in measured["plan"]["trained_on"]]
        hosts = ctx["hosts_of"](ids)
        out["estimated_tokens_per_s"] = round(estimate(trained, hosts, ctx["place"], ctx["block"], ctx["client"],
                                                       None), 1)
        out["estimated_tokens_per_s_shared_cores"] = round(estimate(trained, hosts, ctx["place"], ctx["block"],
                                                                    ctx["client"], os.cpu_count()), 1)
    if joiner:
        host_of[joiner[0].peer_id] = TRAINER_HOST
    measured["stages"] = [[span, [f"h{host_of[p]}" for p in peers]] for span, peers in measured["stages"]]
    out.update(named(measured, {p: f"h{h}" for p, h in host_of.items()}))
    say(f"[{ctx['matrix']}] {name} (repeat {rep}): {measured['tokens_per_s']:.0f} tokens/s, steps "
                  f"{measured['step_seconds']} s" + (f"; estimated {out['estimated_tokens_per_s']:.0f}"
                                                     if "estimated_tokens_per_s" in out else ""))
    return out


# ---- one matrix --------------------------------------------------------------------------------------------------
def run_matrix(matrix: Matrix, args: argparse.Namespace, model_dir: Path, block: Compute, client: ClientCompute,
               workdir: Path) -> dict:
    prefix = f"ptb{secrets.token_hex(3)}"
    result: dict = {"description": matrix.description, "runs": {a: [] for a in args.arrangements}}
    with Testbed(HOSTS, matrix, prefix=prefix, workdir=workdir / "tb") as tb, \
            LocalSwarm(workdir / "swarm", update_period=5.0, train=True) as swarm:
        swarm.probe_max_mib = args.probe_max_mib
        # every peer announces the block compute timed quietly above: they share one compute cache, and a peer
        # timing its block while nine others start on the same 2 cores read it up to 35x slow (a testbed artifact:
        # real hosts have their own cores), which skewed every live plan priced from the records
        config = ModelConfig.from_dir(model_dir)
        (swarm.workdir / "cache").mkdir(parents=True, exist_ok=True)
        quiet = MeasuredCompute(block.forward_s, block.backward_s)  # per token per block, as a peer announces it
        cached_compute(swarm.workdir / "cache", compute_key(config, "cpu", "torch.float32"), lambda: quiet)
        result["sites"] = {h.name: h.site for h in tb.hosts}
        result["rates_bits_per_s"] = tb.describe()["rates_bits_per_s"]
        swarm.start_dht(host=tb.hosts[DHT_HOST])

        def hosts_of(ids: dict[int, str]) -> dict:
            return {CLIENT: tb.hosts[TRAINER_HOST], **{peer: tb.hosts[h] for h, peer in ids.items()}}

        ctx = {"tb": tb, "swarm": swarm, "workdir": workdir, "matrix": matrix.name, "seed": args.seed,
               "block": block, "client": client, "model_dir": model_dir, "steps": args.steps,
               "place": OnTestbed(tb), "hosts_of": hosts_of, "churn": args.churn and matrix.name == "three_sites",
               "repeats": args.repeats, "quick": args.quick}
        if "random" in args.arrangements:
            result["random_draws"] = random_draws(ctx)
        for rep in range(args.repeats):
            for name in args.arrangements:
                try:
                    result["runs"][name].append(run_arrangement(name, rep, ctx))
                except Exception as e:  # reported, and the other arrangements still run
                    say(f"[{matrix.name}] {name} (repeat {rep}) failed: {e}")
                    result.setdefault("failed", []).append({"arrangement": name, "repeat": rep,
                                                            "error": str(e)[-3000:]})
        pids = tb.pids()
    result["nothing_left"] = nothing_left(leftovers(prefix, pids))
    result.update(summarise(result["runs"]))
    draws = result.get("random_draws")
    if draws and result["runs"].get("random"):
        drawn = [r["estimated_tokens_per_s"] for r in result["runs"]["random"]]
        draws["runs_estimated_tokens_per_s"] = drawn
        speed = result["tokens_per_s"]
        for ours in ("plan", "plan_live"):
            if ours in speed:  # against a median draw, priced as the measured draws ran against their estimate
                efficiency = speed["random"] / statistics.median(drawn)
                result["ratios"][f"{ours}_over_median_random_draw"] = round(
                    speed[ours] / (efficiency * draws["median_estimated_tokens_per_s"]), 3)
    return result


def random_draws(ctx: dict, draws: int = RANDOM_DRAWS) -> dict:
    """The estimator's tokens/s for many draws of the ``random`` arrangement (the first group of each; seeds other
    than the runs'): whether the measured draws were lucky, and what a median draw would give."""
    ids = {h: f"h{h}" for h in PEER_HOSTS}
    figures = []
    for i in range(draws):
        layout, first = random_layout(random.Random(RANDOM_DRAW_SEED + i))
        spans = [(ids[h], *map(int, layout[h].split(":"))) for h in first]
        figures.append(estimate(spans, ctx["hosts_of"](ids), ctx["place"], ctx["block"], ctx["client"], None))
    deciles = statistics.quantiles(figures, n=10)
    return {"draws": draws, "median_estimated_tokens_per_s": round(statistics.median(figures), 1),
            "p10": round(deciles[0], 1), "p90": round(deciles[-1], 1)}


def summarise(runs: dict[str, list[dict]]) -> dict:
    """Median tokens/s per arrangement, the ratios and the targets."""
    speed = {name: statistics.median(r["tokens_per_s"] for r in rs) for name, rs in runs.items() if rs}
    out: dict = {"tokens_per_s": {k: round(v, 1) for k, v in speed.items()}}
    ratios: dict = {}
    targets: dict = {}
    bounds: dict = {}
    for ours in ("plan", "plan_live"):
        if ours not in speed:
            continue
        bound = statistics.median(r["estimated_tokens_per_s"] for r in runs[ours])
        shared = statistics.median(r["estimated_tokens_per_s_shared_cores"] for r in runs[ours])
        bounds[ours] = {"own_cores": round(bound, 1), "shared_cores": round(shared, 1)}
        ratios[f"{ours}_over_bound"] = round(speed[ours] / bound, 3)
        ratios[f"{ours}_over_bound_shared_cores"] = round(speed[ours] / shared, 3)
        targets[f"{ours} >= 70% of the estimator's bound (each host its own cores)"] = \
            ratios[f"{ours}_over_bound"] >= 0.7
        targets[f"{ours} >= 70% of the estimator's bound (hosts sharing this machine's cores)"] = \
            ratios[f"{ours}_over_bound_shared_cores"] >= 0.7
        for base, need in (("random", 3.0), ("least_served", 1.5)):
            if base in speed:
                ratios[f"{ours}_over_{base}"] = round(speed[ours] / speed[base], 3)
                targets[f"{ours} >= {need}x {base}"] = ratios[f"{ours}_over_{base}"] >= need
    if bounds:
        out["bound_tokens_per_s"], out["ratios"], out["targets"] = bounds, ratios, targets
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--matrices", default="three_sites,homes", help=f"comma-separated: {', '.join(MATRIX_CHOICES)}")
    parser.add_argument("--arrangements", default=None,
                        help=f"comma-separated: {', '.join(ARRANGEMENTS)} (default: all; quick: plan)")
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps per run (default 20: the first is left out, a slow second weighs "
                             "little; quick 2)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs of each arrangement, interleaved (default 3; quick 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random arrangement")
    parser.add_argument("--no_churn", dest="churn", action="store_false",
                        help="plan_live on three_sites: no stage kill and newcomer in its last run")
    parser.add_argument("--quick", action="store_true",
                        help="three_sites, the plan arrangement, 2 steps, no churn: a check that it works")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "plan_testbed.json")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--probe_max_mib", type=float, default=None,
                        help="the stage peers' --probe_max_mib (default: theirs, 16)")
    args = parser.parse_args()
    matrices = ["three_sites"] if args.quick else [m for m in args.matrices.split(",") if m]
    chosen = args.arrangements or ("plan" if args.quick else ",".join(ARRANGEMENTS))
    args.arrangements = [a for a in chosen.split(",") if a]
    args.churn = args.churn and not args.quick
    if not matrices or any(m not in MATRIX_CHOICES for m in matrices):
        parser.error(f"--matrices: choose from {', '.join(MATRIX_CHOICES)}")
    if not args.arrangements or any(a not in ARRANGEMENTS for a in args.arrangements):
        parser.error(f"--arrangements: choose from {', '.join(ARRANGEMENTS)}")
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    reason = require_root()
    if reason:
        sys.exit(f"plan_testbed.py needs a testbed: {reason}")
    args.steps = args.steps or (2 if args.quick else 20)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fusionswarm-plan-"))
    model_dir = make_tiny_model(workdir / "llama-plan", seed=0, **MODEL)
    t0 = time.perf_counter()
    say("timing one block and the trainer's part on this machine, best of 5 rounds (the planner's and the "
        "estimator's compute)")
    block, client = calibration.measure_compute(model_dir, context=8, rows=TRAIN["micro_batch"],
                                                seq_len=TRAIN["seq_len"])
    result: dict = {"benchmark": "plan_testbed", "quick": args.quick,
                    "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                    "model": {**MODEL, "dtype": "float32"}, "seed": args.seed, "repeats": args.repeats,
                    "probe_max_mib": args.probe_max_mib or 16,
                    "hosts": {f"h{DHT_HOST}": "bootstrap", f"h{TRAINER_HOST}": "trainer",
                              **{f"h{h}": f"peer, memory {MAX_BLOCKS[h]} blocks" for h in PEER_HOSTS}},
                    "train": {**TRAIN, "steps": args.steps, "topology": "chain", "optim": optim(args.steps)},
                    "compute": {"block": asdict(block), "client": asdict(client)}, "matrices": {}}
    for name in matrices:
        say(f"[{name}] testbed of {HOSTS} hosts; arrangements {', '.join(args.arrangements)}")
        result["matrices"][name] = run_matrix(MATRIX_CHOICES[name], args, model_dir, block, client,
                                              workdir / name)
    result["nothing_left"] = all(m["nothing_left"] for m in result["matrices"].values())
    result["seconds"] = round(time.perf_counter() - t0, 1)
    report(result, args.out, write=not args.quick)


if __name__ == "__main__":
    main()
