"""Issue 13 item 3: peers move to other blocks while serving, backups take a place, on real processes.

Moves are driven through each peer's control socket (``swarm peer --control_socket``, the operator's tool), as the
plan follower drives ``StageServer.move_to`` in-process.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from peers.cli.launch import LocalSwarm, SwarmProcess
from peers.client.swarm_client import SwarmClient
from peers.core.config import ClientConfig, SwarmConfig
from peers.model import LocalModel, make_tiny_model
from peers.server.control import send_command
from peers.trainer.swarm_trainer import SwarmTrainer
from peers.training import OptimConfig, TokenBatches, encode_bytes
from peers.wire.errors import MOVED_REFUSAL
from peers.wire.messages import ParamsFetch
from privacy.peer_ids import short_id
from swarm.records import PeerState
from swarm.routing import make_chain

TEXT = "Peers move to other blocks while they serve, and backups wait to take a place. " * 30


@pytest.fixture(scope="module")
def model4(tmp_path_factory) -> Path:
    """A tiny Llama with 4 blocks."""
    return make_tiny_model(tmp_path_factory.mktemp("models") / "llama-4", family="llama", hidden_size=64,
                           num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128, seed=3)


def _control(swarm: LocalSwarm, name: str) -> list[str]:
    return ["--control_socket", str(swarm.workdir / f"{name}.sock")]


def _move(swarm: LocalSwarm, proc: SwarmProcess, span: str) -> str:
    return send_command(swarm.workdir / f"{proc.name}.sock", span if span in ("backup", "status") else f"move {span}",
                        timeout=120)


def _record(client: SwarmClient, peer_id: str):
    return next(r for r in client.records() if r.peer_id == peer_id)


def _wait_record(client: SwarmClient, peer_id: str, state: PeerState, span: tuple[int, int]) -> None:
    """The peer's record as it announced it after the move (stored before the move's answer)."""
    record = _record(client, peer_id)
    assert (record.state, (record.start, record.end)) == (state, span), record


@pytest.fixture(scope="module")
def move_swarm(model4, tmp_path_factory) -> Iterator[tuple[LocalSwarm, dict[str, SwarmProcess]]]:
    """A serves 0:2 (at most 2 blocks), B 2:4, C is a backup, D serves 2:4 from its own copy of the model folder (a
    test breaks it); A, C and D have control sockets."""
    with LocalSwarm(tmp_path_factory.mktemp("moves"), update_period=2.0) as swarm:
        swarm.start_dht()
        own_copy = shutil.copytree(model4, swarm.workdir / "model-d")
        procs = {
            "a": swarm.start_peer(model4, block_indices="0:2", name="a", wait=False,
                                  extra=[*_control(swarm, "a"), "--max_blocks", "2"]),
            "b": swarm.start_peer(model4, block_indices="2:4", name="b", wait=False),
            "c": swarm.start_peer(model4, name="c", wait=False, extra=["--backup", *_control(swarm, "c")]),
            "d": swarm.start_peer(own_copy, block_indices="2:4", name="d", wait=False,
                                  extra=[*_control(swarm, "d"), "--model_name", model4.name]),
        }
        for proc in procs.values():
            swarm.wait_ready(proc)
        yield swarm, procs


def test_bad_spans_are_refused_and_the_peer_keeps_serving(move_swarm, model4):
    """Protects: a move beyond the model or beyond max_blocks, or a malformed command, is refused with a message
    that says why, and the peer goes on serving its span."""
    swarm, procs = move_swarm
    a = procs["a"]
    assert _move(swarm, a, "3:9").startswith("error: cannot move to blocks 3:9: this model has blocks 0:4")
    assert _move(swarm, a, "0:4") == ("error: cannot move to blocks 0:4: that is 4 blocks, and this peer holds at "
                                      "most 2 (--max_blocks, or what its free memory holds)")
    assert _move(swarm, a, "2:1").startswith("error: cannot move to blocks 2:1")
    assert send_command(swarm.workdir / "a.sock", "jump 1:2").startswith("error: unknown command 'jump 1:2'")
    assert send_command(swarm.workdir / "a.sock", "move x:y").startswith("error: bad span 'x:y'")
    assert _move(swarm, a, "status") == "ok: serving 0:2"
    input_ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(5))
    with SwarmClient(model4, initial_peers=swarm.initial_peers) as client:
        client.wait_for_records(4)
        expected = LocalModel.from_dir(model4).forward(input_ids)[0]
        assert torch.allclose(client.forward(input_ids), expected, atol=1e-4)
        assert _record(client, a.peer_id).span == "0:2"


def test_a_move_that_cannot_load_leaves_the_old_span_serving(move_swarm, model4):
    """Protects: a move whose blocks cannot be loaded (here: a broken model folder) is answered with why, logged with
    what to do, and the peer goes on serving its old span."""
    swarm, procs = move_swarm
    d = procs["d"]
    for shard in (swarm.workdir / "model-d").glob("*.safetensors"):
        shard.unlink()  # a new file: the blocks d serves stay mapped from the old one
        shard.write_bytes(b"not a safetensors file")
    answer = _move(swarm, d, "0:2")
    assert answer.startswith("error: could not load blocks 0:2 (") and answer.endswith("this peer still serves "
                                                                                        "blocks 2:4"), answer
    assert "Still serving blocks 2:4; free memory, check the model folder" in d.log()
    assert _move(swarm, d, "status") == "ok: serving 2:4"
    hidden = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(3))
    with SwarmClient(model4, initial_peers=swarm.initial_peers) as client:
        client.wait_for_records(4)
        assert _record(client, d.peer_id).span == "2:4"
        served = client.loop.run(client.call_forward(d.peer_id, hidden, 2, 4))
        reference = client.loop.run(client.call_forward(procs["b"].peer_id, hidden, 2, 4))
        assert torch.allclose(served, reference, atol=1e-5)


@pytest.mark.parametrize("topology", ["chain", "star"])
def test_peer_moves_mid_generation_and_a_backup_takes_its_place(move_swarm, model4, topology, caplog):
    """Protects: a backup announces BACKUP and is never routed to; moved to 0:2 it serves; the peer that served 0:2
    moves to 2:4 while a generation runs through it, the client replays the session elsewhere without banning it,
    and the greedy tokens equal the local model's."""
    swarm, procs = move_swarm
    a, c = procs["a"], procs["c"]
    if topology == "star":  # the chain case left a on 2:4 and c on 0:2: swap them back through the same moves
        assert _move(swarm, a, "backup") == "ok: backup (no blocks)"
        assert _move(swarm, a, "0:2") == "ok: serving 0:2"
        assert _move(swarm, c, "backup") == "ok: backup (no blocks)"
    input_ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(7))
    expected = LocalModel.from_dir(model4).generate_greedy(input_ids, 24)[0, 8:].tolist()
    config = ClientConfig(swarm=SwarmConfig(initial_peers=tuple(swarm.initial_peers)), request_timeout=20,
                          topology=topology)
    with SwarmClient(model4, config=config) as client:
        client.wait_for_records(4)
        backup = _record(client, c.peer_id)
        assert backup.state == PeerState.BACKUP and backup.max_blocks >= 1
        assert all(h.peer_id != c.peer_id for h in make_chain(client.records(), 0, 4))
        tokens = []
        caplog.set_level(logging.INFO, logger="swarm.routing")
        for token in client.iter_generate(input_ids, 24):
            tokens.append(int(token[0]))
            if len(tokens) == 8:
                assert client.info(a.peer_id).sessions == 1 and client.info(c.peer_id).inference_steps == 0
                assert _move(swarm, c, "0:2") == "ok: serving 0:2"  # the backup takes a place first ...
                assert _move(swarm, a, "2:4") == "ok: serving 2:4"  # ... then a leaves 0:2 mid-generation
        assert tokens == expected
        ban = client.router.ban(a.peer_id)  # a step late on a loaded machine may still cost a a short ban
        assert ban is None or MOVED_REFUSAL not in ban.error, f"a peer that moved is healthy: no ban for it ({ban})"
        assert client.info(c.peer_id).inference_steps > 0, "the backup took over blocks 0:2"
        _wait_record(client, a.peer_id, PeerState.ONLINE, (2, 4))
        _wait_record(client, c.peer_id, PeerState.ONLINE, (0, 2))
        # the client saw moved: (or, as the ban check above allows on a loaded machine, its step to a timed out
        # first: seen once in a full suite run, a's log showing neither the step nor a refusal; the replay is the same)
        assert f"Peer {short_id(a.peer_id)} moved off blocks 0:2" in caplog.text or (
            ban is not None and "did not finish a step" in ban.error), caplog.text


@pytest.mark.parametrize("topology", ["chain", "star"])
def test_a_forward_with_a_stale_view_is_rerouted_without_a_ban(move_swarm, model4, topology, caplog):
    """Protects: ``SwarmClient.forward`` whose snapshot predates a move meets the moved: refusal, re-fetches the
    records and routes elsewhere, with no ban; the logits are the local model's."""
    swarm, procs = move_swarm
    a, c = procs["a"], procs["c"]
    input_ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(9))
    config = ClientConfig(swarm=SwarmConfig(initial_peers=tuple(swarm.initial_peers)), request_timeout=20,
                          topology=topology, refresh_period=600, allowed_peers=(a.peer_id, c.peer_id))
    with SwarmClient(model4, config=config) as client:
        client.wait_for_records(2)
        records = client.loop.run(client.router.refresh(force=True))  # kept for 600 s: stale after the swap
        first = next(p for p in (a, c) if any(r.peer_id == p.peer_id and r.span == "0:2" for r in records))
        second = c if first is a else a
        assert _move(swarm, second, "0:2") == "ok: serving 0:2"
        assert _move(swarm, first, "2:4") == "ok: serving 2:4"
        with caplog.at_level(logging.INFO, logger="swarm.routing"):
            logits = client.forward(input_ids)
        assert torch.allclose(logits, LocalModel.from_dir(model4).forward(input_ids)[0], atol=1e-4)
        assert f"Peer {short_id(first.peer_id)} moved off blocks 0:" in caplog.text
        assert client.router.banned() == set()


def test_training_resumes_across_moves_with_the_weights_that_moved(model4, tmp_path):
    """Protects: a trained span splits across a move: the backup fetches blocks 2:4 from the peer serving 0:4 (a
    sub-range ParamsFetch), that peer moves to 0:2 (checkpointing and dropping its run), and the trainer's next step
    re-chooses its stages without banning anyone and resumes at the next step with exactly the weights that moved."""
    with LocalSwarm(tmp_path, update_period=1.0, train=True) as swarm:
        swarm.start_dht()
        a = swarm.start_peer(model4, block_indices="0:4", name="a", wait=False,
                             extra=[*_control(swarm, "a"), "--checkpoint_dir", str(tmp_path / "ckpt-a")])
        b = swarm.start_peer(model4, name="b", wait=False,
                             extra=["--backup", *_control(swarm, "b"), "--checkpoint_dir", str(tmp_path / "ckpt-b")])
        for proc in (a, b):
            swarm.wait_ready(proc)
        client = SwarmClient(model4, config=ClientConfig(swarm=swarm.trainer_config(), request_timeout=20))
        try:
            client.wait_for_records(2)
            optim = OptimConfig(lr=3e-3, warmup_steps=1, clip_norm=1.0)
            trainer = SwarmTrainer(client, optim, accumulation=2, run_id="moves", checkpoint_every=1)
            batches = TokenBatches(encode_bytes(TEXT), seq_len=16, micro_batch=2, seed=1)
            for _ in range(2):
                trainer.train_step([batches.next_micro() for _ in range(2)])
            assert trainer.steps_done == 2 and [s.peer_id for s in trainer.stages] == [a.peer_id]

            def params(peer_id: str, start: int, end: int) -> tuple[int, torch.Tensor]:
                async def fetch():
                    stream = await client.peer_stream(peer_id)
                    reply, flat = await stream.call(ParamsFetch(start=start, end=end), None, 20)
                    return reply.step, flat
                return client.loop.run(fetch())

            step, before_24 = params(a.peer_id, 2, 4)  # a sub-range of a's span 0:4
            _, before_02 = params(a.peer_id, 0, 2)
            assert step == 2
            assert _move(swarm, b, "2:4") == "ok: serving 2:4"
            assert _move(swarm, a, "0:2") == "ok: serving 0:2"
            assert (tmp_path / "ckpt-a" / "moves" / "blocks-0-4" / "state.json").is_file(), "checkpoint of the old span"
            step_b, after_24 = params(b.peer_id, 2, 4)
            step_a, after_02 = params(a.peer_id, 0, 2)
            assert torch.equal(after_24, before_24) and torch.equal(after_02, before_02)
            assert (step_a, step_b) == (2, 2)
            result = trainer.train_step([batches.next_micro() for _ in range(2)])
            assert trainer.steps_done == 3 and result.stage_peers == [a.peer_id, b.peer_id]
            assert result.stage_steps == [3, 3], "the moved spans count on from the run's step"
            assert client.router.ban(a.peer_id) is None and client.router.ban(b.peer_id) is None
            assert torch.isfinite(torch.tensor(result.loss)) and not trainer.lost_steps
        finally:
            client.close()
