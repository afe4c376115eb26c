"""The workload estimator (swarm.estimator) against measured runs: per-token latency and training tokens/s.

    python benchmarks/estimator.py [--matrices lan,three_sites,home] [--loopback] [--out FILE] [--workdir DIR]

1. Calibration, on 127.0.0.1 and in this process, before any case runs (estimator_calibration.py): each block's
   compute and the client's own part, timed the way peers and clients run them; the stream's CPU per message; the
   rest of a round trip to one real peer (transit per message, the p2p daemons' rate).
2. For each matrix: a testbed of 6 hosts (``swarm.testbed``, root needed); the DHT and the client/trainer on host 0,
   and stage peers for 3 pipelines: one stage on the nearest host; two stages (nearest, then the best host of
   another site); three stages (nearest, another site, the slowest site). The client/trainer runs inside host 0
   (estimator_worker.py): generation (per-token latency), then training with K = 1 and K = 4 micro-batches in flight.
   ``--loopback``: the same pipelines on 127.0.0.1 without a testbed (links unshaped).
3. The estimator gets the calibrated compute and stream costs and the links' *configured* rates
   (``Testbed.rate``: on the wire, so TCP goodput is 1448/1514 of them; a home host's upload is one queue shared by
   all its links); latency 0 (the testbed adds none). Nothing is fitted on the measured runs.

Prints one JSON object (progress on stderr): each case's predicted and measured figures, relative errors, and the
median absolute relative error over all of them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import estimator_calibration as calibration
import torch
from rich.console import Console

from peers.model import make_tiny_model
from privacy.identity import Identity
from privacy.peer_ids import peer_id_of
from swarm.estimator import (
    CLIENT,
    ClientCompute,
    Compute,
    Link,
    ModelShape,
    Pipeline,
    Stage,
    StreamCost,
    estimate_inference,
    estimate_training,
)

MODEL = dict(family="llama", hidden_size=1024, num_layers=6, num_heads=8, num_kv_heads=4, intermediate_size=1024)
CONTEXT, NEW, RUNS = 8, 24, 2  # generation: prompt, new tokens, runs per case
ROWS, SEQ_LEN, MICRO_BATCHES, IN_FLIGHT, STEPS = 2, 32, 4, (1, 4), 4  # training
PIPELINES = {  # name -> (role of the stage's host, start, end) per stage
    "one_stage": [("near", 0, 6)],
    "two_stages": [("near", 0, 3), ("mid", 3, 6)],
    "three_stages": [("near", 0, 2), ("mid", 2, 4), ("far", 4, 6)],
}
SETTLE_S = 15.0  # seconds after the peers serve before the first case
READY_PEER = re.compile(r"Serving blocks (\d+):(\d+) of \S+ as peer (\w+)")
READY_DHT = re.compile(r"--initial_peers (.+)$", re.MULTILINE)
HERE = Path(__file__).resolve().parent
console = Console(stderr=True)


# ---- where processes run -------------------------------------------------------------------------------------
class Loopback:
    """Processes on 127.0.0.1 in this namespace; each in its own process group, stopped by PID on close."""

    name = "loopback"

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.handles: list[subprocess.Popen] = []
        self.hosts = [None] * 6

    def address(self, host) -> str:
        return "127.0.0.1"

    def spawn(self, host, argv: list[str], name: str) -> tuple[subprocess.Popen, Path]:
        log = self.workdir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as out:
            handle = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True)
        self.handles.append(handle)
        return handle, log

    def rate(self, a, b) -> float:
        return float("inf")

    def shared(self, a, b) -> str | None:
        return None

    def roles(self) -> dict[str, int]:
        return {"client": 0, "near": 1, "mid": 2, "far": 3}

    def close(self) -> None:
        for handle in reversed(self.handles):
            if handle.poll() is None:
                os.killpg(handle.pid, signal.SIGTERM)
        for handle in self.handles:
            try:
                handle.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(handle.pid, signal.SIGKILL)
                handle.wait(5)


class OnTestbed:
    """Processes in the hosts of a ``swarm.testbed.Testbed``."""

    def __init__(self, testbed) -> None:
        self.tb, self.name = testbed, testbed.matrix.name
        self.hosts = testbed.hosts

    def address(self, host) -> str:
        return host.address

    def spawn(self, host, argv: list[str], name: str) -> tuple[subprocess.Popen, Path]:
        handle = self.tb.spawn(host, argv, name=name)
        return handle, handle.log_path

    def rate(self, a, b) -> float:
        return self.tb.rate(a, b)

    def shared(self, a, b) -> str | None:
        """The queue a link shares with others: its sender's upload (or receiver's download) when that binds."""
        rate, matrix, n = self.tb.rate(a, b), self.tb.matrix, self.tb.n
        if matrix.up(a.index, n) == rate:
            return f"up:{a.name}"
        if matrix.down(b.index, n) == rate:
            return f"down:{b.name}"
        return None

    def roles(self) -> dict[str, int]:
        """near: the fastest host from host 0; mid: the fastest of another site; far: the slowest."""
        client = self.hosts[0]
        others = sorted(self.hosts[1:], key=lambda h: (-self.tb.rate(client, h), h.index))
        near = others[0]
        mid = next((h for h in others[1:] if h.site != near.site), others[1])
        far = next((h for h in reversed(others) if h not in (near, mid)), others[2])
        return {"client": 0, "near": near.index, "mid": mid.index, "far": far.index}

    def close(self) -> None:
        pass  # the testbed stops its processes


def wait_log(handle: subprocess.Popen, log: Path, pattern: re.Pattern, timeout: float, what: str) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        if match := pattern.search(text):
            return match
        if handle.poll() is not None:
            raise RuntimeError(f"{what} exited with {handle.returncode}; its log {log}:\n{text[-3000:]}")
        time.sleep(0.2)
    raise RuntimeError(f"{what} was not ready after {timeout:.0f} s; see {log}")


# ---- one matrix ----------------------------------------------------------------------------------------------
def run_matrix(place, model_dir: Path, workdir: Path, trainer_path: Path) -> list[dict]:
    """Start the DHT and every pipeline's peers, then measure each pipeline from host 0, each just after measuring
    the compute again (plain medians, under the machine's load of the moment)."""
    trainer_id = peer_id_of(Identity.load_or_create(trainer_path).public_bytes)
    roles = place.roles()
    client_host = place.hosts[roles["client"]]
    dht, log = place.spawn(client_host, [sys.executable, "-m", "peers.cli", "dht", "--host_maddrs",
                                         f"/ip4/{place.address(client_host)}/tcp/0"], "dht")
    line = wait_log(dht, log, READY_DHT, 60, "the DHT").group(1)
    initial = [m for m in line.split() if f"/ip4/{place.address(client_host)}/" in m] or line.split()
    peers: dict[tuple[str, int, int], tuple[str, subprocess.Popen, Path]] = {}
    for name, stages in PIPELINES.items():
        for role, start, end in stages:
            host = place.hosts[roles[role]]
            argv = [sys.executable, "-m", "peers.cli", "peer", str(model_dir), "--initial_peers", *initial,
                    "--host_maddrs", f"/ip4/{place.address(host)}/tcp/0", "--block_indices", f"{start}:{end}",
                    "--trainers", trainer_id, "--num_threads", "1", "--update_period", "10",
                    "--cache_dir", str(workdir / "cache"), "--throughput", "1000"]
            handle, log = place.spawn(host, argv, f"{place.name}-{name}-{start}-{end}")
            peers[(name, start, end)] = ("", handle, log)
    for key, (_, handle, log) in list(peers.items()):
        peer_id = wait_log(handle, log, READY_PEER, 180, f"peer {key}").group(3)
        peers[key] = (peer_id, handle, log)
    console.print(f"[{place.name}] DHT and {len(peers)} peers serving; {SETTLE_S:.0f} s for them to settle")
    time.sleep(SETTLE_S)  # new peers still join the DHT and announce: no compute timing meanwhile
    cases = []
    for name, stages in PIPELINES.items():
        allowed = [peers[(name, start, end)][0] for _, start, end in stages]
        out = workdir / f"{place.name}-{name}.json"
        argv = [sys.executable, str(HERE / "estimator_worker.py"), "--model", str(model_dir), "--initial_peers",
                *initial, "--allowed", ",".join(allowed), "--identity", str(trainer_path), "--out", str(out),
                "--context", str(CONTEXT), "--new", str(NEW), "--runs", str(RUNS), "--rows", str(ROWS),
                "--seq_len", str(SEQ_LEN), "--micro_batches", str(MICRO_BATCHES),
                "--in_flight", ",".join(map(str, IN_FLIGHT)), "--steps", str(STEPS)]
        load = os.getloadavg()[0]
        block, client = calibration.measure_compute(model_dir, context=CONTEXT, rows=ROWS, seq_len=SEQ_LEN, rounds=1)
        t0 = time.monotonic()
        worker, log = place.spawn(client_host, argv, f"{place.name}-{name}-worker")
        try:
            code = worker.wait(600)
        except subprocess.TimeoutExpired:
            worker.kill()
            raise RuntimeError(f"the worker of {place.name}/{name} took over 600 s; see {log}") from None
        if code != 0:
            raise RuntimeError(f"the worker of {place.name}/{name} failed ({code}); its log {log}:\n"
                               f"{log.read_text(errors='replace')[-3000:]}")
        measured = json.loads(out.read_text())
        console.print(f"[{place.name}] {name}: measured in {time.monotonic() - t0:.0f} s: "
                      f"{measured['token_latency_s'] * 1e3:.2f} ms/token, "
                      + ", ".join(f"K={k} {v['tokens_per_s']:.0f} tok/s" for k, v in measured["training"].items()))
        hosts = {CLIENT: client_host, **{peers[(name, s, e)][0]: place.hosts[roles[r]] for r, s, e in stages}}
        cases.append({"matrix": place.name, "pipeline": name, "stages": [
            {"peer": peers[(name, s, e)][0][-8:], "host": roles[r], "blocks": f"{s}:{e}"} for r, s, e in stages],
            "hosts": hosts, "allowed": allowed, "measured": measured, "block": block, "client": client,
            "load_before": round(load, 2), "load_after": round(os.getloadavg()[0], 2)})
    return cases


# ---- predictions ---------------------------------------------------------------------------------------------
def links_of(place, hosts: dict) -> dict[tuple[str, str], Link]:
    links = {}
    for a, ha in hosts.items():
        for b, hb in hosts.items():
            if a == b:
                continue
            if ha is hb or (ha is None and hb is None and place.name == "loopback"):
                rate = float("inf")
            else:
                rate = place.rate(ha, hb)
            links[(a, b)] = Link(rate if rate != float("inf") else 1e13, 0.0,
                                 shared=None if ha is hb else place.shared(ha, hb))
    return links


def predict(case: dict, links: dict[tuple[str, str], Link], block: Compute, client: ClientCompute,
            stream: StreamCost, cores: int | None = None) -> dict:
    """The estimator's figures for a case; ``cores``: every host shares this machine's cores (None: each has its
    own, as the estimator assumes of a real swarm)."""
    stages = tuple(Stage(peer, int(s["blocks"].split(":")[0]), int(s["blocks"].split(":")[1]), block)
                   for peer, s in zip(case["allowed"], case["stages"], strict=True))
    pipeline = Pipeline(stages, links, client=client)
    model = ModelShape(hidden_size=MODEL["hidden_size"], num_blocks=MODEL["num_layers"], dtype_bytes=4)
    inference = estimate_inference(model, pipeline, stream=stream)
    names = {CLIENT: "client", **{peer: f"stage{i}" for i, peer in enumerate(case["allowed"])}}
    result = {"links": {f"{names[a]}->{names[b]}": [link.bandwidth, link.shared]
                        for (a, b), link in pipeline.links.items()},
              "token_latency_s": inference.token_latency_s, "inference_breakdown_s": {
        "compute": inference.compute_s, "client": inference.client_s, "link": inference.link_s,
        "stream": inference.stream_s}, "training": {}}
    for k in IN_FLIGHT:
        train = estimate_training(model, pipeline, rows=ROWS, seq_len=SEQ_LEN, micro_batches=MICRO_BATCHES,
                                  in_flight=k, stream=stream, cores=cores)
        result["training"][str(k)] = {"tokens_per_s": train.tokens_per_s, "step_s": train.step_s,
                                      "commit_s": train.commit_s, "bottleneck": train.bottleneck}
    return result


def relative(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


def compare(cases: list[dict]) -> tuple[list[dict], dict]:
    """Each figure against the best measured (the best run's median, the fastest step: what calibration is too) and
    against the plain median of all runs or steps."""
    rows = []
    errors: dict[str, list[float]] = {"best": [], "median": []}
    matrix_errors: dict[str, list[float]] = {}

    def figure(predicted: float, best: float, median: float, scale: float, matrix: str) -> dict:
        error, plain = relative(predicted, best), relative(predicted, median)
        errors["best"].append(error)
        errors["median"].append(plain)
        matrix_errors.setdefault(matrix, []).append(abs(error))
        return {"predicted": round(predicted * scale, 3), "measured_best": round(best * scale, 3),
                "measured_median": round(median * scale, 3), "error": round(error, 3),
                "error_vs_median": round(plain, 3)}

    for case in cases:
        p, m, matrix = case["predicted"], case["measured"], case["matrix"]
        row = {"matrix": matrix, "pipeline": case["pipeline"], "stages": case["stages"],
               "token_latency_ms": figure(p["token_latency_s"], m.get("token_latency_best_s", m["token_latency_s"]),
                                          m["token_latency_s"], 1e3, matrix),
               "inference_breakdown_ms": {k: round(v * 1e3, 3) for k, v in p["inference_breakdown_s"].items()},
               "training": {}, "links_bits_per_s": p["links"], "measured_raw": m,
               "compute": {"block": asdict(case["block"]), "client": asdict(case["client"])},
               "load": [case["load_before"], case["load_after"]]}
        for k, predicted in p["training"].items():
            measured = m["training"][k]
            row["training"][f"K={k}"] = {
                "tokens_per_s": figure(predicted["tokens_per_s"], measured.get("tokens_per_s_best",
                                       measured["tokens_per_s"]), measured["tokens_per_s"], 1.0, matrix),
                "step_s": {"predicted": round(predicted["step_s"], 4), "measured": measured["step_s"]},
                "predicted_commit_s": round(predicted["commit_s"], 4), "bottleneck": predicted["bottleneck"]}
        rows.append(row)
    best = [abs(e) for e in errors["best"]]
    summary = {"figures": len(best), "median_abs_error": round(statistics.median(best), 3),
               "max_abs_error": round(max(best), 3), "within_20pct": sum(e <= 0.2 for e in best),
               "median_abs_error_vs_median": round(statistics.median(abs(e) for e in errors["median"]), 3),
               "median_error_signed": round(statistics.median(errors["best"]), 3)}
    for matrix, own in sorted(matrix_errors.items()):
        summary[f"median_abs_error_{matrix}"] = round(statistics.median(own), 3)
    return rows, summary


def evaluate(cases: list[dict], quiet_block: Compute, quiet_client: ClientCompute, stream: StreamCost) -> dict:
    """Predictions for every case (the compute measured just before it; the start's best-of-5 compute; the hosts
    sharing this machine's cores) against what was measured."""
    def predicted(block_of, client_of, cores=None) -> list[dict]:
        return [{**c, "predicted": predict(c, c["links"], block_of(c), client_of(c), stream, cores)} for c in cases]

    rows, summary = compare(predicted(lambda c: c["block"], lambda c: c["client"]))
    shared_rows, shared = compare(predicted(lambda c: c["block"], lambda c: c["client"], os.cpu_count()))
    return {"cases": rows, "summary": summary,
            "summary_with_quiet_compute": compare(predicted(lambda c: quiet_block, lambda c: quiet_client))[1],
            "summary_with_shared_cores": shared,
            "training_with_shared_cores": [{"matrix": r["matrix"], "pipeline": r["pipeline"],
                                            **{k: v["tokens_per_s"] for k, v in r["training"].items()}}
                                           for r in shared_rows]}


def replay(path: Path) -> dict:
    """Predict again, with this estimator, every case of a previous run's JSON, from the inputs it recorded (the
    calibration, each case's compute and links): nothing is measured, nothing fitted."""
    saved = json.loads(path.read_text())
    calibrated = saved["calibration"]
    cases = []
    for row in saved["cases"]:
        names = [f"stage{i}" for i in range(len(row["stages"]))]
        links = {}
        for pair, (bandwidth, shared) in row["links_bits_per_s"].items():
            a, b = pair.split("->")
            links[(a, b)] = Link(bandwidth, 0.0, shared=shared)
        cases.append({"matrix": row["matrix"], "pipeline": row["pipeline"], "stages": row["stages"],
                      "allowed": names, "links": links, "measured": row["measured_raw"],
                      "block": Compute(**row["compute"]["block"]), "client": ClientCompute(**row["compute"]["client"]),
                      "load_before": row["load"][0], "load_after": row["load"][1]})
    return {**{k: v for k, v in saved.items() if k not in ("cases", "summary")}, **evaluate(
        cases, Compute(**calibrated["quiet_block"]), ClientCompute(**calibrated["quiet_client"]),
        StreamCost(**calibrated["stream"])), "replayed_from": str(path)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--matrices", default="lan,three_sites", help="testbed matrices, comma-separated")
    parser.add_argument("--loopback", action="store_true", help="run the pipelines on 127.0.0.1 (no testbed)")
    parser.add_argument("--calibrate_only", action="store_true", help="print the calibration and stop")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--replay", type=Path, default=None,
                        help="predict again the cases of this earlier JSON output from its recorded inputs")
    args = parser.parse_args()
    if args.replay:
        text = json.dumps(replay(args.replay), indent=1)
        print(text)
        if args.out:
            args.out.write_text(text + "\n")
        return
    torch.set_num_threads(1)  # like every peer: all processes share this machine's cores
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fusionswarm-estimator-"))
    model_dir = make_tiny_model(workdir / "model", seed=0, **MODEL)
    trainer_path = workdir / "trainer.id"
    with console.status("calibrating on 127.0.0.1: compute (best of 5 rounds), stream CPU, transit to one peer"):
        block, client = calibration.measure_compute(model_dir, context=CONTEXT, rows=ROWS, seq_len=SEQ_LEN)
        cpu = calibration.measure_stream_cpu(MODEL["hidden_size"], ROWS * SEQ_LEN)
        stream, raw = calibration.measure_transit(model_dir, workdir, cpu=cpu, rows=ROWS, seq_len=SEQ_LEN)
    calibrated = {"quiet_block": asdict(block), "quiet_client": asdict(client), "stream": asdict(stream),
                  "transit_raw": raw}
    console.print(f"calibration: {json.dumps(calibrated)}")
    result: dict = {"model": MODEL, "generation": {"context": CONTEXT, "new_tokens": NEW, "runs": RUNS},
                    "training": {"rows": ROWS, "seq_len": SEQ_LEN, "micro_batches": MICRO_BATCHES,
                                 "in_flight": list(IN_FLIGHT), "steps": STEPS},
                    "calibration": calibrated, "links": "configured rates (Testbed.rate), latency 0"}
    if not args.calibrate_only:
        cases = []
        places = [("loopback", None)] if args.loopback else [(m, m) for m in args.matrices.split(",") if m]
        for label, matrix in places:
            with contextlib.ExitStack() as stack:
                if matrix is None:
                    place = stack.enter_context(contextlib.closing(Loopback(workdir / "loopback")))
                else:
                    from swarm.testbed import Testbed

                    place = OnTestbed(stack.enter_context(Testbed(hosts=6, matrix=matrix, workdir=workdir / label)))
                for case in run_matrix(place, model_dir, workdir / label, trainer_path):
                    case["links"] = links_of(place, case.pop("hosts"))
                    cases.append(case)
        result.update(evaluate(cases, block, client, stream))
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
