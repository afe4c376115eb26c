"""The trainer of benchmarks/plan_testbed.py, run inside the trainer's testbed host: one training run, timed.

    python benchmarks/plan_testbed_worker.py SPEC.json OUT.json

SPEC names the model folder, the initial peers, this host's address, the trainer's identity, the peers it may use
(``allowed``: the arrangement's pipeline, or every peer started for it; empty: any), the run id (whose step-0
checkpoints the peers hold) and the training parameters. Without ``plan`` the trainer picks its stages among the
allowed peers as today (``swarm.stages``: whole spans tiling the blocks, replicas of a span sharing the
micro-batches); with ``plan`` it is the broker of its run (``SwarmTrainer(plan=True)``: it plans, publishes, the
peers move, it trains on the plan's group it prices fastest). It trains ``steps`` steps and writes each step's
seconds, tokens, loss and the stages it ran on; tokens/s leaves out the first step (it opens the run).

``churn`` (with ``plan``), after the timed steps: SIGKILL to the process group of one stage peer of the group it
trains on (``pids``: peer id -> pid), ``after_kill`` more steps (seconds from the kill until each ends, steps lost,
the plan that replaced the victim); then it asks for a new peer (writes ``join_request``; the benchmark starts it
and writes its peer id to ``join_id``), waits until the swarm shows it with its measured links, has its run planned
again (its stages cleared: the next step re-plans, as after a failure) and trains ``after_join`` steps: does the
next plan give the newcomer a place, and does the run train on it?
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import open_run  # noqa: E402

from peers.client.swarm_client import SwarmClient  # noqa: E402
from peers.core.config import ClientConfig, SwarmConfig  # noqa: E402
from peers.trainer.swarm_trainer import SwarmTrainer  # noqa: E402
from peers.training import OptimConfig, TokenBatches, encode_bytes, read_corpus  # noqa: E402


def run(spec: dict) -> dict:
    tr = spec["train"]
    swarm = SwarmConfig(initial_peers=tuple(spec["initial_peers"]), host_maddrs=(f"/ip4/{spec['address']}/tcp/0",),
                        identity_path=spec["identity_path"])
    config = ClientConfig(swarm=swarm, allowed_peers=tuple(spec["allowed"]), request_timeout=60)
    batches = TokenBatches(encode_bytes(read_corpus()), tr["seq_len"], tr["micro_batch"], seed=tr["seed"])
    with SwarmClient(spec["model_dir"], config=config) as client:
        client.wait_for_records(spec["wait_records"], timeout=180)
        extra = {"plan": True, "pipeline_wait": 300, "checkpoint_every": 1} if spec.get("plan") else {}
        trainer = SwarmTrainer(client, OptimConfig(**tr["optim"]), tr["accumulation"], in_flight=tr["in_flight"],
                               run_id=spec["run_id"], rechoose_every=0.0, **extra)
        t0 = time.perf_counter()
        open_run(trainer)
        opened = time.perf_counter() - t0
        steps = [trainer.train_step([batches.next_micro() for _ in range(tr["accumulation"])])
                 for _ in range(tr["steps"])]
        timed = steps[1:]
        out = {
            "tokens_per_s": round(sum(s.tokens for s in timed) / sum(s.seconds for s in timed), 1),
            "step_seconds": [round(s.seconds, 3) for s in steps],
            "tokens_per_step": steps[0].tokens,
            "losses": [round(s.loss, 5) for s in steps],
            "open_seconds": round(opened, 2),
            "stages": [[f"{r.start}:{r.end}", [r.peer_id for r in group]] for group in trainer.replicas
                       for r in group[:1]],
            "micro_batches_per_replica": trainer.shares,
        }
        if spec.get("plan"):
            out["plan"] = plan_of(trainer)
        if spec.get("churn"):
            out["churn"] = churn(spec, trainer, batches)
        return out


def plan_of(trainer: SwarmTrainer) -> dict:
    plan = trainer.planner.plan
    return {"version": plan.version, "groups": [[[s.peer_id, s.start, s.end] for s in g.stages] for g in plan.groups],
            "group_tokens_per_s": [round(g.tokens_per_s, 1) for g in plan.groups], "backups": list(plan.backups),
            "trained_on": [[r.peer_id, r.start, r.end] for r in trainer.stages]}


def churn(spec: dict, trainer: SwarmTrainer, batches: TokenBatches) -> dict:
    """Kill a stage of the run mid-training, train on; then a newcomer joins and the run is planned again."""
    tr, c = spec["train"], spec["churn"]

    def step():
        return trainer.train_step([batches.next_micro() for _ in range(tr["accumulation"])])

    stages = [r.peer_id for r in trainer.stages]
    victim = stages[len(stages) // 2]
    before = plan_of(trainer)
    done_before = trainer.steps_done
    killed = time.monotonic()
    os.killpg(c["pids"][victim], signal.SIGKILL)
    after = []
    for _ in range(c["after_kill"]):
        result = step()
        after.append({"ended_s_after_kill": round(time.monotonic() - killed, 2), "seconds": round(result.seconds, 3),
                      "loss": round(result.loss, 5)})
    replaced = plan_of(trainer)
    out: dict = {"victim": victim, "plan_before": before, "steps_after_kill": after,
                 "seconds_to_recover": after[0]["ended_s_after_kill"] if after else None,
                 "steps_done": trainer.steps_done - done_before, "steps_asked": c["after_kill"],
                 "lost_steps": [{k: v for k, v in lost.items() if k != "message"} for lost in trainer.lost_steps],
                 "plan_after_kill": replaced,
                 "victim_replaced_by": sorted(set(p for p, _, _ in replaced["trained_on"]) - set(stages))}
    Path(c["join_request"]).write_text("join")
    deadline = time.monotonic() + 300
    while not Path(c["join_id"]).exists():
        if time.monotonic() > deadline:
            raise TimeoutError("the benchmark started no newcomer")
        time.sleep(0.5)
    newcomer = Path(c["join_id"]).read_text().strip()
    t0 = time.monotonic()
    while time.monotonic() - t0 < c["join_wait"]:  # its record, with the links it measured when it joined
        record = next((r for r in trainer.client.records() if r.peer_id == newcomer), None)
        if record is not None and len(record.links) >= c["join_links"]:
            break
        time.sleep(1.0)
    out["newcomer"] = newcomer
    out["newcomer_seen_after_s"] = round(time.monotonic() - t0, 1)
    out["newcomer_links"] = len(record.links) if record is not None else 0
    trainer.stages = []  # the next step chooses again: the run's broker plans anew (hysteresis decides)
    joined = [step() for _ in range(c["after_join"])]
    final = plan_of(trainer)
    place = next(([a, b] for g in final["groups"] for p, a, b in g if p == newcomer), None)
    out.update({"plan_after_join": final, "newcomer_place": place,
                "newcomer_trained_on": any(p == newcomer for p, _, _ in final["trained_on"]),
                "steps_after_join_seconds": [round(r.seconds, 3) for r in joined]})
    return out


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    Path(sys.argv[2]).write_text(json.dumps(run(spec)))


if __name__ == "__main__":
    main()
