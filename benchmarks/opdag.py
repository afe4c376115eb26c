"""Operator-graph training through the swarm (issue 18): images/s of a ResNet cut into 3 stages on 3 graph peers
(``swarm peer --graph ARCH --graph_stage I/3``) trained by a ``GraphTrainer`` (star, two-phase steps, micro-batches in
flight), against the same steps in one process; and the cut the planner chose against an equal split by node count
(``--graph_split equal``), in the same run. Prints one JSON line (and writes it to ``--out``).

    python benchmarks/opdag.py --arch resnet50 --batch 8 --image_size 64 --steps 3                 # loopback
    sudo python benchmarks/opdag.py --testbed three_sites --batch 8 --image_size 64 --steps 3      # the testbed

Loopback (one machine; ``--threads`` per process): the peers share its cores and no link is slow, so the figure says
what the swarm path costs (encryption, framing, the star's round trips, the pipeline's fill and drain), not a
speed-up. Arrangements ``plan`` (the planner's cut, 1 Gbit/s links assumed) and ``equal``.

``--testbed three_sites`` (root): six hosts of ``swarm.testbed``'s three_sites matrix (h0, h1 in site a, h2, h3 in b,
h4, h5 in c: 10 Gbit/s inside a site, 100 Mbit/s a-b, 8 Mbit/s to c); the DHT and stage 0 on h0, the trainer on h1,
stage 1 on h2 (site b), stage 2 on h4 (site c). In the star every cut's tensors cross two of the trainer's links, so
the planner is told the slower of the two for each cut (``--graph_links``: 100 and 8 Mbit/s). Arrangements
``plan_links`` (that plan), ``plan`` (the planner blind to the links: 1 Gbit/s each) and ``equal``. Every namespace
and process is removed at the end, also on failure.
"""

from __future__ import annotations

import argparse
import copy
import json
import secrets
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from opdag_worker import batches, graph_spec, train  # noqa: E402

from peers.cli.launch import LocalSwarm  # noqa: E402
from peers.trainer.graph_trainer import GraphTrainer  # noqa: E402

console = Console(stderr=True)
TESTBED_HOSTS, DHT_HOST, TRAINER_HOST, STAGE_HOSTS = 6, 0, 1, (0, 2, 4)


def one_process(spec: dict) -> float:
    torch.set_num_threads(spec["threads"])
    model = copy.deepcopy(graph_spec(spec).trace().gm).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    began = 0.0
    for i, micro in enumerate(batches(spec)):
        if i == 1:
            began = time.perf_counter()  # the first step warms up
        for x, y in micro:
            (F.cross_entropy(model(x), y) / len(micro)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return spec["steps"] * spec["micro"] * spec["batch"] / (time.perf_counter() - began)


def peer_flags(spec: dict, split: str, links: list[float] | None) -> list[str]:
    return ["--graph_config", f"num_classes={spec['classes']}", "--graph_inputs",
            f"batch={spec['batch']},image_size={spec['image_size']}", "--graph_split", split,
            *(["--graph_links", ",".join(f"{r:g}" for r in links)] if links else [])]


def on_loopback(spec: dict, split: str, workdir: Path) -> dict:
    with LocalSwarm(workdir / split, update_period=2.0, num_threads=spec["threads"], train=True) as swarm:
        swarm.start_dht()
        procs = [swarm.start_graph_peer(spec["arch"], stage=f"{i}/3", extra=peer_flags(spec, split, None),
                                        wait=False) for i in range(3)]
        ranges = [swarm.wait_graph_ready(p, timeout=300)[:2] for p in procs]
        with GraphTrainer(graph_spec(spec), swarm.trainer_config(), run_id=f"bench-{split}",
                          in_flight=spec["in_flight"], request_timeout=120) as trainer:
            out = train(trainer, spec)
    return {**out, "stages": [f"{a}:{b}" for a, b in ranges]}


def star_links(tb) -> list[float]:
    """Mbit/s the planner is told for each cut: the slower of the trainer's links to the stages on either side."""
    trainer = tb.hosts[TRAINER_HOST]
    legs = [min(tb.rate(tb.hosts[h], trainer), tb.rate(trainer, tb.hosts[h])) if h != TRAINER_HOST else float("inf")
            for h in STAGE_HOSTS]
    return [min(legs[i], legs[i + 1]) / 1e6 for i in range(len(STAGE_HOSTS) - 1)]


def on_testbed(spec: dict, arrangement: str, tb, swarm: LocalSwarm, workdir: Path) -> dict:
    split = "equal" if arrangement == "equal" else "plan"
    links = star_links(tb) if arrangement == "plan_links" else None
    procs = [swarm.start_graph_peer(spec["arch"], stage=f"{i}/3", extra=peer_flags(spec, split, links), wait=False,
                                    name=f"{arrangement}-stage{i}", host=tb.hosts[h])
             for i, h in enumerate(STAGE_HOSTS)]
    try:
        ranges = [swarm.wait_graph_ready(p, timeout=300)[:2] for p in procs]
        run = {**spec, "initial_peers": swarm.initial_peers, "address": tb.hosts[TRAINER_HOST].address,
               "identity_path": str(swarm.trainer_identity()), "run_id": f"bench-{arrangement}"}
        spec_path, out_path = workdir / f"{arrangement}.spec.json", workdir / f"{arrangement}.out.json"
        spec_path.write_text(json.dumps(run))
        worker = tb.spawn(tb.hosts[TRAINER_HOST], [sys.executable, str(HERE / "opdag_worker.py"), str(spec_path),
                                                   str(out_path)], name=f"{arrangement}-trainer")
        if worker.wait(timeout=1800) != 0 or not out_path.exists():
            raise RuntimeError(f"the trainer of {arrangement} failed (exit {worker.returncode}):\n"
                               f"{worker.log_path.read_text(errors='replace')[-3000:]}")
        out = json.loads(out_path.read_text())
    finally:
        for proc in procs:
            proc.stop(timeout=15)
            swarm.processes.remove(proc)
    return {**out, "stages": [f"{a}:{b}" for a, b in ranges], **({"links_mbit": links} if links else {})}


def testbed_runs(spec: dict, matrix: str, arrangements: list[str], workdir: Path) -> dict:
    from swarm.testbed import Testbed, require_root
    from swarm.testbed.cleanup import leftovers, nothing_left

    if reason := require_root():
        raise SystemExit(f"--testbed {reason}")
    prefix = f"opd{secrets.token_hex(3)}"
    runs: dict = {}
    with Testbed(TESTBED_HOSTS, matrix, prefix=prefix, workdir=workdir / "tb") as tb, \
            LocalSwarm(workdir / "swarm", update_period=5.0, num_threads=spec["threads"], train=True) as swarm:
        swarm.start_dht(host=tb.hosts[DHT_HOST])
        for arrangement in arrangements:
            console.print(f"[{matrix}] {arrangement}: starting 3 graph peers on h0, h2, h4", markup=False)
            runs[arrangement] = on_testbed(spec, arrangement, tb, swarm, workdir)
            console.print(f"[{matrix}] {arrangement}: {runs[arrangement]['images_per_s']} images/s, stages "
                          f"{runs[arrangement]['stages']}", markup=False)
        rates = tb.describe()["rates_bits_per_s"]
        pids = tb.pids()
    return {"runs": runs, "rates_bits_per_s": rates, "nothing_left": nothing_left(leftovers(prefix, pids))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8, help="images per micro-batch")
    parser.add_argument("--image_size", type=int, default=64)
    parser.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--in_flight", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--testbed", default=None, metavar="MATRIX", help="run on the testbed (root): three_sites")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    spec = {k: getattr(args, k) for k in ("arch", "classes", "batch", "image_size", "micro", "in_flight", "steps",
                                          "threads")}
    console.print(f"one process: {args.arch}, {args.steps + 1} steps", markup=False)
    local = one_process(spec)
    with tempfile.TemporaryDirectory(prefix="opdag-") as tmp:
        if args.testbed:
            arrangements = ["plan_links", "plan", "equal"]
            result = testbed_runs(spec, args.testbed, arrangements, Path(tmp))
            runs = result.pop("runs")
        else:
            arrangements = ["plan", "equal"]
            runs = {a: on_loopback(spec, a, Path(tmp)) for a in arrangements}
            result = {}
    best = arrangements[0]
    out = {**spec, "where": args.testbed or "loopback", "one_process_images_per_s": round(local, 3), **runs,
           f"{best}_vs_one_process": round(runs[best]["images_per_s"] / local, 3),
           **{f"{best}_vs_{a}": round(runs[best]["images_per_s"] / runs[a]["images_per_s"], 3)
              for a in arrangements[1:]}, **result}
    line = json.dumps(out)
    print(line)
    if args.out:
        args.out.write_text(line + "\n")


if __name__ == "__main__":
    main()
