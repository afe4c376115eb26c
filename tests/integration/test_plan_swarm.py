"""Issue 13 item 2: a trainer is the broker of its run, on real processes on 127.0.0.1.

Peers that do not tile the model (and a backup) move to the trainer's signed plan; the run's losses equal one
process's; a stage peer killed mid-run is re-planned around (the backup takes its place) and training goes on.
"""

from __future__ import annotations

import math
import signal
from pathlib import Path

import pytest

from peers.cli.launch import LocalSwarm
from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig
from peers.model import make_tiny_model
from peers.trainer.swarm_trainer import SwarmTrainer
from peers.training import LocalTrainer, OptimConfig, TokenBatches, encode_bytes
from swarm.discovery import fetch_plans
from swarm.records import PeerState

OPTIM = OptimConfig(lr=3e-3, warmup_steps=1, schedule="cosine", total_steps=8, clip_norm=1.0, weight_decay=0.01)
TEXT = "A trainer plans its run, the peers move to the plan, and a backup waits for a place. " * 30


@pytest.fixture(scope="module")
def model4(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "llama-4", family="llama", hidden_size=64,
                           num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128, seed=5)


def _batches() -> TokenBatches:
    return TokenBatches(encode_bytes(TEXT), seq_len=16, micro_batch=2, seed=3)


def test_trainer_plans_its_run_peers_move_and_a_backup_replaces_a_killed_stage(model4, tmp_path):
    accumulation = 2
    with LocalSwarm(tmp_path, update_period=1.0, train=True) as swarm:
        swarm.start_dht()
        two = ["--max_blocks", "2"]  # 3 peers of 2 blocks for 4 blocks: one pipeline of 2 and a backup
        procs = [swarm.start_peer(model4, block_indices="0:1", name="a", wait=False, extra=two),
                 swarm.start_peer(model4, block_indices="2:3", name="b", wait=False, extra=two),  # 1 and 3: nobody
                 swarm.start_peer(model4, name="c", wait=False, extra=["--backup", *two])]
        for proc in procs:
            swarm.wait_ready(proc)
        by_id = {p.peer_id: p for p in procs}
        config = ClientConfig(swarm=swarm.trainer_config(), request_timeout=20)
        with SwarmClient(model4, config=config) as client:
            client.wait_for_records(3)
            trainer = SwarmTrainer(client, OPTIM, accumulation, run_id="planned", plan=True, pipeline_wait=90,
                                   checkpoint_every=1)
            stages = trainer.start()
            plan = trainer.planner.plan
            assert plan is not None and plan.version == 0 and plan.run_id == "planned"
            assert len(plan.groups) == 1 and len(plan.backups) == 1  # memory allows one pipeline only
            spans = [(s.start, s.end) for s in stages]
            assert spans == [s.span for s in plan.groups[0].stages] and spans[0][0] == 0 and spans[-1][1] == 4
            published = client.loop.run(fetch_plans(client.node, client.model_name))
            assert [p.version for p in published if p.run_id == "planned"] == [0]  # signed, readable by others
            records = {r.peer_id: r for r in client.records()}
            for stage in plan.groups[0].stages:  # the peers moved: they announce the planned spans
                assert (records[stage.peer_id].state, records[stage.peer_id].start, records[stage.peer_id].end) == (
                    PeerState.ONLINE, stage.start, stage.end)

            reference = LocalTrainer(model4, OPTIM, accumulation, stages=spans)
            data_swarm, data_local = _batches(), _batches()
            for _ in range(3):
                swarm_loss = trainer.train_step([data_swarm.next_micro() for _ in range(accumulation)]).loss
                local_loss = reference.train_step([data_local.next_micro() for _ in range(accumulation)])
                assert swarm_loss == pytest.approx(local_loss, abs=1e-5)

            victim = plan.groups[0].stages[-1].peer_id
            backup = plan.backups[0]
            by_id[victim].kill(signal.SIGKILL)
            losses = [trainer.train_step([data_swarm.next_micro() for _ in range(accumulation)]).loss
                      for _ in range(3)]
            assert all(math.isfinite(loss) for loss in losses)
            replanned = trainer.planner.plan
            assert replanned.version >= 1 and victim not in replanned.peers
            assert backup in {s.peer_id for s in trainer.stages}  # the backup took a place
            assert trainer.steps_done == 6
            log = by_id[backup].log()
            assert "Following plan v" in log and "Moving to blocks" in log
