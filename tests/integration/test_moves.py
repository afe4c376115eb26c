"""Issue 13 item 3: peers move to other blocks while serving, backups take a place, on real processes.

Moves are driven through each peer's control socket (``swarm peer --control_socket``, the operator's tool), as the
plan follower drives ``StageServer.move_to`` in-process.
"""

from __future__ import annotations

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
from peers.wire.messages import ParamsFetch
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
    """A serves 0:2 (at most 2 blocks), B 2:4, C is a backup; A and C have control sockets."""
    with LocalSwarm(tmp_path_factory.mktemp("moves"), update_period=2.0) as swarm:
        swarm.start_dht()
        procs = {
            "a": swarm.start_peer(model4, block_indices="0:2", name="a", wait=False,
                                  extra=[*_control(swarm, "a"), "--max_blocks", "2"]),
            "b": swarm.start_peer(model4, block_indices="2:4", name="b", wait=False),
            "c": swarm.start_peer(model4, name="c", wait=False, extra=["--backup", *_control(swarm, "c")]),
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
        client.wait_for_records(3)
        expected = LocalModel.from_dir(model4).forward(input_ids)[0]
        assert torch.allclose(client.forward(input_ids), expected, atol=1e-4)
        assert _record(client, a.peer_id).span == "0:2"


@pytest.mark.parametrize("topology", ["chain", "star"])
def test_peer_moves_mid_generation_and_a_backup_takes_its_place(move_swarm, model4, topology):
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
        client.wait_for_records(3)
        backup = _record(client, c.peer_id)
        assert backup.state == PeerState.BACKUP and backup.max_blocks >= 1
        assert all(h.peer_id != c.peer_id for h in make_chain(client.records(), 0, 4))
        tokens = []
        for token in client.iter_generate(input_ids, 24):
            tokens.append(int(token[0]))
            if len(tokens) == 8:
                assert client.info(a.peer_id).sessions == 1 and client.info(c.peer_id).inference_steps == 0
                assert _move(swarm, c, "0:2") == "ok: serving 0:2"  # the backup takes a place first ...
                assert _move(swarm, a, "2:4") == "ok: serving 2:4"  # ... then a leaves 0:2 mid-generation
        assert tokens == expected
        assert client.router.ban(a.peer_id) is None, "a peer that moved is healthy: no ban"
        assert client.info(c.peer_id).inference_steps > 0, "the backup took over blocks 0:2"
        _wait_record(client, a.peer_id, PeerState.ONLINE, (2, 4))
        _wait_record(client, c.peer_id, PeerState.ONLINE, (0, 2))
        assert "moved: this peer now serves 2:4 (it served 0:2)" in a.log() or topology == "star"
        # a plain forward on a's old span from a fresh client with a stale view is refused as moved, no ban
        with SwarmClient(model4, config=config) as other:
            assert torch.allclose(other.forward(input_ids), LocalModel.from_dir(model4).forward(input_ids)[0], atol=1e-4)


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
