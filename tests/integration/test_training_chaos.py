"""What ``benchmarks/chaos.py --mode train`` found, on real processes: a lone stage's peer killed between its last
backward and the commit gets the step replayed when it is back (no step half-applied); a train step waits for a
lone stage's peer that restarts instead of failing after 5 s; a replica that rejoins averages in the same rounds
as the others (no refusal, no 30 s timeout)."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator

import pytest
import torch
from safetensors.torch import load_file
from torch.nn.utils import vector_to_parameters

from peers.cli.launch import LocalSwarm, SwarmProcess
from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig
from peers.trainer.swarm_trainer import SwarmTrainer
from peers.training import LocalTrainer, OptimConfig, TokenBatches, encode_bytes
from peers.wire.messages import ParamsFetch

OPTIM = OptimConfig(lr=3e-3, warmup_steps=1, schedule="cosine", total_steps=6, clip_norm=1.0, weight_decay=0.01)
TEXT = "A stage peer dies, comes back from its checkpoint, and the run goes on as if nothing happened. " * 40


def _flags(swarm: LocalSwarm, name: str) -> list[str]:
    """Its own identity (the same peer id after a restart) and checkpoint folder."""
    return ["--identity_path", str(swarm.workdir / f"{name}.id"), "--checkpoint_dir", str(swarm.workdir / name)]


def _peers(swarm: LocalSwarm, llama_dir, spans: dict[str, str]) -> dict[str, SwarmProcess]:
    procs = {name: swarm.start_peer(llama_dir, block_indices=span, wait=False, name=name, extra=_flags(swarm, name))
             for name, span in spans.items()}
    for proc in procs.values():
        swarm.wait_ready(proc)
    return procs


PAIR = {"stage0": "0:4", "stage1": "4:8"}


@pytest.fixture(scope="module")
def shared_pair(llama_dir, tmp_path_factory) -> Iterator[LocalSwarm]:
    """Stage peers 0:4 and 4:8 shared by the tests that kill one of them and restart it (same identity and
    checkpoints; a reference takes the weights they serve: ``_reference``)."""
    with LocalSwarm(tmp_path_factory.mktemp("chaos_pair"), update_period=1.0, train=True) as swarm:
        swarm.start_dht()
        _peers(swarm, llama_dir, PAIR)
        yield swarm


@pytest.fixture
def pair(shared_pair, llama_dir) -> tuple[LocalSwarm, dict[str, SwarmProcess]]:
    """The module's pair, each stage's running process by name; a stage that an earlier test killed and did not
    bring back (it failed) is restarted first."""
    swarm, procs, dead = shared_pair, {}, {}
    for name, span in PAIR.items():
        running = [p for p in swarm.processes if p.name.split("-")[0] == name and p.popen.poll() is None]
        if running:
            procs[name] = running[-1]
        else:
            dead[name] = span
    procs.update({name: _restart(swarm, llama_dir, name, wait=False) for name in dead})
    for proc in procs.values():
        swarm.wait_ready(proc)  # also one a test restarted without waiting: its peer id is read from its log
    return swarm, procs


def _restart(swarm: LocalSwarm, llama_dir, name: str, wait: bool = True) -> SwarmProcess:
    """Stage ``name`` again: its identity and checkpoints (a log of its own)."""
    return swarm.start_peer(llama_dir, block_indices=PAIR[name], name=f"{name}-again{len(swarm.processes)}",
                            wait=wait, extra=_flags(swarm, name))


def _reference(client: SwarmClient, llama_dir, procs: dict[str, SwarmProcess], accumulation: int) -> LocalTrainer:
    """One process with the model's embedding and head and the blocks the stages serve now (earlier tests of the
    module trained them): exactly their parameters, fetched from them."""
    reference = LocalTrainer(llama_dir, OPTIM, accumulation, stages=[(0, 4), (4, 8)])
    for block, name in zip(reference.blocks, PAIR, strict=True):
        stream = client.loop.run(client.peer_stream(procs[name].peer_id))
        _, flat = client.loop.run(stream.call(ParamsFetch(start=procs[name].blocks[0], end=procs[name].blocks[1]),
                                              None, 10))
        with torch.no_grad():
            vector_to_parameters(flat, block.parameters())
    return reference


def _client(swarm: LocalSwarm, llama_dir, peers: int) -> SwarmClient:
    client = SwarmClient(llama_dir, config=ClientConfig(swarm=swarm.trainer_config(), request_timeout=60))
    client.wait_for_records(peers)
    return client


def _kill_before_commit(trainer: SwarmTrainer, proc: SwarmProcess, at_step: int) -> None:
    """SIGKILL ``proc`` (and its p2p daemon) after the last backward of step ``at_step``, before its commit."""
    commit = trainer._commit

    async def kill_then_commit(stage_steps):
        if trainer.steps_done == at_step:
            proc.kill()
            proc.popen.wait(10)
        await commit(stage_steps)

    trainer._commit = kill_then_commit


@pytest.mark.parametrize("topology, killed", [("chain", 1), ("chain", 0), ("star", 1)])
def test_finding_chaos_a_lone_stage_killed_before_the_commit_gets_the_step_replayed(pair, llama_dir, caplog,
                                                                                    topology, killed):
    """The other stage and the trainer applied step 3; the killed peer comes back from its checkpoint at step 2,
    gets step 3 replayed (the same inputs and gradients, in the same order) and the run equals one process. In a
    chain the trainer never saw the killed stage's input (stage 1) or its output and grad (stage 0): the other
    stage kept them."""
    caplog.set_level(logging.INFO, logger="peers")
    (swarm, procs), accumulation, run_id = pair, 2, f"replay-{topology}-{killed}"
    data_swarm, data_local = (TokenBatches(encode_bytes(TEXT), seq_len=16, micro_batch=2, seed=4) for _ in range(2))
    with _client(swarm, llama_dir, 2) as client:
        reference = _reference(client, llama_dir, procs, accumulation)
        trainer = SwarmTrainer(client, OPTIM, accumulation, in_flight=1, run_id=run_id, checkpoint_every=1,
                               topology=topology)
        _kill_before_commit(trainer, procs[f"stage{killed}"], at_step=2)
        for step in range(1, 5):
            result = trainer.train_step([data_swarm.next_micro() for _ in range(accumulation)])
            assert result.loss == pytest.approx(reference.train_step(
                [data_local.next_micro() for _ in range(accumulation)]), abs=1e-6)
            if step == 3:  # the killed stage died before applying it: the others did
                assert result.stage_steps == ([3, 2] if killed else [2, 3])
                _restart(swarm, llama_dir, f"stage{killed}", wait=False)
            else:
                assert result.stage_steps == [step, step], "the restarted stage must not stay a step behind"
        assert trainer.replayed == 1 and trainer.lost_steps == []
        assert "forwards identical to the first time's" in caplog.text  # it held exactly the weights of step 2
        ids = data_local.next_micro()
        assert (client.forward(ids) - reference.logits(ids).detach()).abs().max() <= 1e-6
    span = ("blocks-0-4", "blocks-4-8")[killed]
    saved = load_file(str(swarm.workdir / f"stage{killed}" / run_id / span / "weights.safetensors"))
    local = dict(reference.blocks[killed].named_parameters())
    assert max((saved[k] - local[k].detach()).abs().max().item() for k in saved) <= 1e-6


def test_finding_chaos_a_stage_back_from_an_older_checkpoint_is_a_loud_lost_step(pair, llama_dir, caplog):
    """Peers that checkpoint every 2 steps: the 4:8 peer killed before applying step 4 comes back at step 2, two
    steps behind. That cannot be replayed: an error says which blocks lost which steps and how to avoid it, the
    trainer keeps it in ``lost_steps``, and the steps the stages report show the difference."""
    swarm, procs = pair
    data = TokenBatches(encode_bytes(TEXT), seq_len=16, micro_batch=2, seed=7)
    with _client(swarm, llama_dir, 2) as client:
        trainer = SwarmTrainer(client, OPTIM, 2, run_id="lost", checkpoint_every=2)
        _kill_before_commit(trainer, procs["stage1"], at_step=3)
        for _ in range(4):
            trainer.train_step([data.next_micro() for _ in range(2)])
        _restart(swarm, llama_dir, "stage1")
        result = trainer.train_step([data.next_micro() for _ in range(2)])
    assert result.stage_steps == [5, 3] and trainer.replayed == 0
    assert [{k: v for k, v in lost.items() if k != "message"} for lost in trainer.lost_steps] == [
        {"blocks": "4:8", "step": 2, "run_expected": 4, "lost": 2}]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("blocks 4:8 LOST 2 step(s)" in m and "checkpoint_every = 1" in m for m in errors)


class _Waiting(logging.Handler):
    """Sets ``event`` once the trainer says it has waited ``seconds`` for its stages' peers."""

    def __init__(self, seconds: float) -> None:
        super().__init__(logging.INFO)
        self.seconds, self.event = seconds, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        found = re.search(r"waiting for the stages' peers .* for (\d+) s so far", record.getMessage())
        if found and int(found.group(1)) >= self.seconds:
            self.event.set()


def test_finding_chaos_a_train_step_waits_for_a_lone_stage_whose_peer_restarts(pair, llama_dir):
    """The 4:8 peer is killed and restarted only once the trainer has waited 6 s for it (it used to raise
    NoPipelineError after 5 s, which stopped `swarm train`): the step goes on when the peer serves again."""
    swarm, procs = pair
    data = TokenBatches(encode_bytes(TEXT), seq_len=16, micro_batch=2, seed=5)
    waiting, finished = _Waiting(6), threading.Event()
    logger = logging.getLogger("peers.trainer.pipeline")
    logger.addHandler(waiting)
    logger.setLevel(logging.INFO)

    def restart_when_waited() -> None:
        while not finished.is_set():
            if waiting.event.wait(0.2):
                _restart(swarm, llama_dir, "stage1", wait=False)
                return

    try:
        with _client(swarm, llama_dir, 2) as client:
            trainer = SwarmTrainer(client, OPTIM, 2, run_id="wait", checkpoint_every=1, pipeline_wait=120)
            for step in (1, 2):
                assert trainer.train_step([data.next_micro() for _ in range(2)]).stage_steps == [step, step]
            procs["stage1"].kill()
            procs["stage1"].popen.wait(10)
            restarter = threading.Thread(target=restart_when_waited, daemon=True)
            restarter.start()
            try:
                result = trainer.train_step([data.next_micro() for _ in range(2)])
            finally:
                finished.set()
                restarter.join(30)
            assert waiting.event.is_set() and result.stage_steps == [3, 3] and trainer.lost_steps == []
    finally:
        logger.removeHandler(waiting)


def _weights(swarm: LocalSwarm, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(swarm.workdir / name / "rejoin" / "blocks-4-8" / "weights.safetensors"))


def test_finding_chaos_a_replica_that_rejoins_averages_in_the_same_round(fresh_swarm, llama_dir):
    """Replica b of 4:8 is killed before it applies step 4 and comes back (from step 3) before the next step: it
    catches up to step 4 and its new averager starts at the run's round, so after step 6 both replicas hold the
    same weights (it used to push round 0 while a was at round 3: refused, and a waited out the 30 s timeout)."""
    swarm = fresh_swarm
    procs = _peers(swarm, llama_dir, {"first": "0:4", "a": "4:8", "b": "4:8"})
    data = TokenBatches(encode_bytes(TEXT), seq_len=16, micro_batch=2, seed=6)
    with _client(swarm, llama_dir, 3) as client:
        trainer = SwarmTrainer(client, OptimConfig(lr=5e-3), 4, in_flight=4, run_id="rejoin", checkpoint_every=1,
                               average_every=2, rechoose_every=0.1)
        _kill_before_commit(trainer, procs["b"], at_step=3)
        for _ in range(4):
            trainer.train_step([data.next_micro() for _ in range(4)])
        again = swarm.start_peer(llama_dir, block_indices="4:8", name="b-again", extra=_flags(swarm, "b"))
        client.wait_for_records(3)
        for step in (5, 6):
            result = trainer.train_step([data.next_micro() for _ in range(4)])
            assert [len(group) for group in trainer.replicas] == [1, 2] and result.stage_steps == [step, step]
    weights = _weights(swarm, "a"), _weights(swarm, "b")
    assert weights[0].keys() == weights[1].keys() and all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    for proc in (procs["a"], again):
        assert "is over" not in proc.log() and "none within" not in proc.log()
