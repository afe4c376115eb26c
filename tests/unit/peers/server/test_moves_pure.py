"""The pure parts of moves (issue 13 item 3): the moved: refusal and how clients classify it, the control socket's
commands and permissions, memory in blocks, the config's move flags, a sub-range ParamsFetch and a retired run."""

from __future__ import annotations

import asyncio
import socket
import stat
from pathlib import Path

import pytest
import torch

from peers.client.retry import classify, is_final
from peers.core.config import StageServerConfig, SwarmConfig
from peers.core.trainers import TrainerPolicy
from peers.model import ModelConfig, load_blocks, make_tiny_model
from peers.server.control import MAX_LINE, parse_command, run_command, send_command, serve_control
from peers.server.memory import SAFETY_MARGIN, block_bytes, free_bytes, holdable_blocks
from peers.server.training_rpc import TrainingRPC
from peers.training import OptimConfig
from peers.wire.errors import ChainError, MovedError, RequestError, is_moved, moved_refusal
from peers.wire.messages import ParamsFetch, StageInfo, TrainOpen

ME = "12D3KooW" + "A" * 44


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("moves") / "tiny", hidden_size=32, num_layers=4, num_heads=2,
                           num_kv_heads=1, intermediate_size=64)


# ---- the moved: refusal ---------------------------------------------------------------------------------------
def test_moved_refusal_says_what_the_peer_serves_now_and_is_no_failure():
    text = moved_refusal((3, 6), (0, 3))
    assert text.startswith("moved: this peer now serves 3:6 (it served 0:3)")
    assert moved_refusal(None, (0, 3)).startswith("moved: this peer is a backup and serves no blocks (it served 0:3)")
    refused = classify(RequestError(f"peer ...abc refused the session: {text}"))
    assert isinstance(refused, MovedError) and not is_final(refused)
    assert is_moved(ChainError(f"could not hand the output to the next peer: peer x refused: {text}", "x"))
    assert not is_moved(RequestError("this peer serves blocks 0:4, not 4:8")) and is_final(RequestError("no"))


# ---- the control socket ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("line, parsed", [("move 2:4", ("move", (2, 4))), ("move 2 4", ("move", (2, 4))),
                                          (" MOVE 0:1 ", ("move", (0, 1))), ("backup", ("backup", None)),
                                          ("status", ("status", None))])
def test_control_commands_parse(line, parsed):
    assert parse_command(line) == parsed


@pytest.mark.parametrize("line, match", [("", "empty command"), ("move", "unknown command"), ("move a:b", "bad span"),
                                         ("move 1:2:3", "bad span"), ("backup now", "unknown command"),
                                         ("rm -rf /", "unknown command")])
def test_bad_control_commands_say_what_is_accepted(line, match):
    with pytest.raises(ValueError, match=match):
        parse_command(line)


class FakePeer:
    """A ``Movable`` that refuses spans beyond 4 blocks, as ``StageServer.move_to`` does."""

    def __init__(self) -> None:
        self.span: tuple[int, int] | None = (0, 2)

    async def move_to(self, start: int, end: int) -> None:
        if not 0 <= start < end <= 4:
            raise ValueError(f"cannot move to blocks {start}:{end}")
        self.span = (start, end)

    async def become_backup(self) -> None:
        self.span = None


def test_control_socket_is_owner_only_bounded_and_answers_one_line(tmp_path):
    peer, path = FakePeer(), tmp_path / "peer.sock"

    async def scenario() -> list[str]:
        listener = await serve_control(path, peer)
        try:
            mode = stat.S_IMODE(path.stat().st_mode)
            assert stat.S_ISSOCK(path.stat().st_mode) and mode == 0o600, oct(mode)
            ask = lambda line: asyncio.to_thread(send_command, path, line, 10)  # noqa: E731
            answers = [await ask("move 2:4"), await ask("move 3:9"), await ask("backup"), await ask("status")]
            answers.append(await asyncio.to_thread(_raw, path, b"x" * (MAX_LINE + 10) + b"\n"))
            return answers
        finally:
            listener.close()

    answers = asyncio.run(scenario())
    assert answers[:4] == ["ok: serving 2:4", "error: cannot move to blocks 3:9", "ok: backup (no blocks)",
                           "ok: backup (no blocks)"]
    assert answers[4].startswith("error: send one line of at most 256")
    with pytest.raises(ValueError, match="at most 255 bytes"):
        send_command(path, "move " + "1" * 300)


def _raw(path: Path, data: bytes) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        sock.sendall(data)
        return sock.recv(4096).decode().strip()


def test_control_socket_refuses_a_path_that_is_no_socket(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("keep me")
    with pytest.raises(ValueError, match="is no socket"):
        asyncio.run(serve_control(path, FakePeer()))
    assert path.read_text() == "keep me"


def test_run_command_reports_errors_as_a_line():
    peer = FakePeer()
    assert asyncio.run(run_command(peer, "move 1:3")) == "ok: serving 1:3"
    assert asyncio.run(run_command(peer, "hop")).startswith("error: unknown command")
    assert peer.span == (1, 3)


# ---- memory in blocks -----------------------------------------------------------------------------------------
def test_block_bytes_match_a_loaded_block(model_dir):
    config = ModelConfig.from_dir(model_dir)
    loaded = load_blocks(model_dir, 0, 1)
    real = sum(p.numel() * p.element_size() for p in loaded.parameters())
    assert block_bytes(config, torch.float32) == real
    assert block_bytes(config, torch.float16) == real // 2


def test_holdable_blocks_leave_a_margin_and_never_drop_below_the_span():
    per_block = 1000
    free = int(10 * per_block / (1 - SAFETY_MARGIN)) + 1  # room for 10 blocks after the margin
    assert holdable_blocks(free, per_block, num_layers=80) == 10
    assert holdable_blocks(free, per_block, num_layers=80, serving=3) == 13  # besides the 3 loaded
    assert holdable_blocks(free, per_block, num_layers=6) == 6  # never more than the model
    assert holdable_blocks(free, per_block, num_layers=80, training=True) == 2  # weights, grads, 2 moments
    assert holdable_blocks(0, per_block, num_layers=80, serving=5) == 5  # never below what it serves
    assert holdable_blocks(0, per_block, num_layers=80) == 1


def test_free_bytes_reads_available_ram(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:  100 kB\nMemAvailable:    8000000 kB\n")
    assert free_bytes(torch.device("cpu"), meminfo) == 8000000 * 1024
    assert free_bytes(torch.device("cpu"), tmp_path / "missing") == 0


# ---- the config's move flags ----------------------------------------------------------------------------------
def test_move_flags_are_checked(model_dir):
    swarm = SwarmConfig(new_swarm=True)
    backup = StageServerConfig(model_dir=model_dir, swarm=swarm, backup=True, max_blocks=3, follow_plans=False)
    assert backup.block_indices is None and not backup.follow_plans and backup.max_blocks == 3
    assert StageServerConfig(model_dir=model_dir, swarm=swarm, num_blocks=2).follow_plans
    with pytest.raises(ValueError, match="--backup starts with no blocks"):
        StageServerConfig(model_dir=model_dir, swarm=swarm, backup=True, block_indices=(0, 2))
    with pytest.raises(ValueError, match="or --backup"):
        StageServerConfig(model_dir=model_dir, swarm=swarm)
    with pytest.raises(ValueError, match="at least the 3 block"):
        StageServerConfig(model_dir=model_dir, swarm=swarm, block_indices=(1, 4), max_blocks=2)


# ---- the training side of a move ------------------------------------------------------------------------------
def _rpc(model_dir: Path, start: int, end: int) -> TrainingRPC:
    info = StageInfo(peer_id=ME, model="tiny", start=start, end=end, hidden_size=32, dtype="float32",
                     max_batch_size=8, max_seq_len=64, max_request_bytes=1 << 20, throughput=1.0, version="test")
    return TrainingRPC(load_blocks(model_dir, start, end), info, trainers=TrainerPolicy(("anyone",)),
                       stream_for=None)


def test_params_fetch_answers_any_sub_range_of_the_span(model_dir):
    whole, part = _rpc(model_dir, 0, 4), _rpc(model_dir, 1, 3)
    try:
        assert torch.equal(whole.current_params(ParamsFetch(start=1, end=3)), part.current_flat())
        assert torch.equal(whole.current_params(ParamsFetch(start=0, end=4)), whole.current_flat())
        with pytest.raises(RequestError, match="serves 1:3, not 0:2"):
            part.current_params(ParamsFetch(start=0, end=2))
        flat = whole.current_params(ParamsFetch(start=2, end=3)) + 1.0
        whole.load_range(2, 3, flat)
        assert torch.equal(whole.current_flat(2, 3), flat)
        with pytest.raises(ValueError, match="expected"):
            whole.load_range(2, 3, flat[:-1])
    finally:
        whole.shutdown()
        part.shutdown()


def test_a_retired_run_is_saved_and_refused_as_moved(model_dir, tmp_path):
    """The span a peer leaves: its run is checkpointed, and every later call (open included) gets moved:."""
    rpc, stream = _rpc(model_dir, 0, 2), object()
    rpc.checkpoint_dir = tmp_path
    open_ = TrainOpen(run_id="r", start=0, end=2, optim=OptimConfig().to_dict(), accumulation=1, explicit_apply=True)
    asyncio.run(rpc.open(open_, stream))
    rpc.trainer.part.step_count = 4
    refusal = moved_refusal((2, 4), (0, 2))
    asyncio.run(rpc.retire(refusal))
    assert (tmp_path / "r" / "blocks-0-2" / "state.json").is_file()
    assert rpc.trainer is None and rpc.retired
    with pytest.raises(MovedError, match="^moved: this peer now serves 2:4"):
        asyncio.run(rpc.open(open_, stream))
    with pytest.raises(MovedError):
        rpc._trainer("r", stream)


def test_a_run_opened_after_a_move_counts_from_the_weights_carried(model_dir):
    rpc, stream = _rpc(model_dir, 2, 4), object()
    rpc.moved, rpc.carried_step = moved_refusal((2, 4), (0, 2)), 5
    try:
        open_ = TrainOpen(run_id="r", start=2, end=4, optim=OptimConfig().to_dict(), accumulation=1,
                          explicit_apply=True)
        assert asyncio.run(rpc.open(open_, stream)) == 5
        with pytest.raises(MovedError):  # the old span's requests get moved:, not a plain refusal
            asyncio.run(rpc.open(TrainOpen(run_id="r", start=0, end=2, optim=OptimConfig().to_dict(),
                                           accumulation=1), stream))
    finally:
        rpc.shutdown()




def test_swarm_move_sends_one_line_and_exits_by_the_answer(tmp_path, capsys):
    """``swarm move --control_socket PATH SPAN``: 0 and the peer's ``ok: ...`` line, 1 on its refusal, 2 (with
    what to check) when no peer listens there."""
    from peers.cli.commands import main

    peer, path = FakePeer(), tmp_path / "peer.sock"

    async def scenario() -> list[int]:
        listener = await serve_control(path, peer)
        try:
            return [await asyncio.to_thread(main, ["move", "--control_socket", str(path), span])
                    for span in ("2:4", "1:9", "backup")]
        finally:
            listener.close()

    assert asyncio.run(scenario()) == [0, 1, 0]
    assert capsys.readouterr().out.splitlines() == ["ok: serving 2:4", "error: cannot move to blocks 1:9",
                                                    "ok: backup (no blocks)"]
    assert main(["move", "--control_socket", str(tmp_path / "none.sock"), "0:2"]) == 2
