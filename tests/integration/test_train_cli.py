"""``swarm train`` on real processes: three stage peers and one trainer; resume; a pipeline that does not tile.

Also the trainer-state round trip (``peers.trainer.state``), which needs no swarm.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from peers.cli.launch import LocalSwarm
from peers.model import load_client_parts
from peers.trainer.state import load_trainer_state, save_trainer_state, trainer_checkpoint_path
from peers.training import OptimConfig, PartOptimizer, unique_parameters
from peers.training.state import read_state_info

SPANS = ("0:3", "3:6", "6:8")


def _write_config(path: Path, model_dir: Path, **overrides) -> Path:
    values = {"model_dir": str(model_dir), "seq_len": 32, "batch_size": 8, "micro_batch": 4, "in_flight": 4,
              "steps": 20, "seed": 0, **overrides}
    lines = [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    lines += ["[optim]", "lr = 3e-3", "warmup_steps = 2", 'schedule = "constant"']
    path.write_text("\n".join(lines) + "\n")
    return path


def _train(swarm: LocalSwarm, config: Path, *args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess,
                                                                                          dict | None]:
    done = subprocess.run([sys.executable, "-m", "peers.cli", "train", str(config), "--initial_peers",
                           *swarm.initial_peers, *swarm.trainer_flags(), "--eval_windows", "8", *args],
                          capture_output=True, text=True, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("summary ")]
    return done, json.loads(lines[-1][len("summary "):]) if lines else None


@pytest.fixture(scope="module")
def stage_swarm(llama_dir, tmp_path_factory) -> Iterator[LocalSwarm]:
    """Blocks 0:3, 3:6 and 6:8 of the tiny Llama on three peers that checkpoint their blocks."""
    workdir = tmp_path_factory.mktemp("train_cli")
    with LocalSwarm(workdir, update_period=1.0, train=True) as swarm:
        swarm.start_dht()
        procs = [swarm.start_peer(llama_dir, block_indices=span, wait=False, name=f"stage{i}",
                                  extra=["--checkpoint_dir", str(workdir / f"peer{i}")])
                 for i, span in enumerate(SPANS)]
        for proc in procs:
            swarm.wait_ready(proc)
        yield swarm


def test_loss_falls_with_three_stage_peers_and_one_trainer(stage_swarm, llama_dir, tmp_path):
    config = _write_config(tmp_path / "falls.toml", llama_dir, steps=20)
    done, summary = _train(stage_swarm, config, "--eval_every", "10")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert summary["run_id"] == "falls" and summary["steps_done"] == 20 and not summary["resumed"]
    assert summary["held_out_after"] < summary["held_out_before"] - 0.5, summary
    assert set(summary["utilisation"]) == set(SPANS)
    assert summary["stage_steps"] == [20, 20, 20] and summary["topology"] == "chain"  # the default
    assert set(summary["held_out"]) == {"0", "10", "20"}  # start, every 10 steps, end


def test_a_rerun_with_the_same_run_id_resumes(stage_swarm, llama_dir, tmp_path):
    config = _write_config(tmp_path / "resume.toml", llama_dir, steps=4, checkpoint_dir=str(tmp_path / "ckpt"),
                           checkpoint_every=2)
    done, first = _train(stage_swarm, config, "--eval_every", "0")
    assert done.returncode == 0, done.stderr[-3000:]
    saved = trainer_checkpoint_path(tmp_path / "ckpt", "resume")
    assert read_state_info(saved)["steps_done"] == 4 and read_state_info(saved)["micro_batches_drawn"] == 8
    for i, span in enumerate(SPANS):  # the peers saved their blocks of this run too
        start, end = span.split(":")
        assert read_state_info(stage_swarm.workdir / f"peer{i}" / "resume" / f"blocks-{start}-{end}")["step"] == 4

    done, second = _train(stage_swarm, config, "--steps", "7", "--eval_every", "0", "--topology", "star")
    assert done.returncode == 0, done.stderr[-3000:]
    assert second["topology"] == "star"  # a run may change topology when it resumes: the weights are the same
    assert "Resumed run resume at step 4" in done.stdout
    assert second["resumed"] and second["start_step"] == 4 and second["steps_done"] == 7
    assert second["stage_steps"] == [7, 7, 7] and "warning" not in done.stdout
    # the trained embedding + head were loaded: the held-out loss continues where the first run ended
    assert second["held_out_before"] == pytest.approx(first["held_out_after"], abs=1e-5)
    assert read_state_info(saved)["steps_done"] == 7

    changed = _write_config(tmp_path / "resume.toml", llama_dir, steps=9, seq_len=16,
                            checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2)
    done, _ = _train(stage_swarm, changed)
    assert done.returncode == 2 and "seq_len=32 -> 16" in done.stderr and "--run_id NEW" in done.stderr


def test_spans_that_do_not_tile_the_model_are_a_clear_error(fresh_swarm, llama_dir, tmp_path, swarm_cli):
    for proc in [fresh_swarm.start_peer(llama_dir, block_indices=span, wait=False) for span in ("0:3", "6:8")]:
        fresh_swarm.wait_ready(proc)
    config = _write_config(tmp_path / "gap.toml", llama_dir)
    done = swarm_cli("train", str(config), "--initial_peers", *fresh_swarm.initial_peers, *fresh_swarm.trainer_flags(),
                     "--eval_windows", "8", "--wait_peers", "3")  # in this process: no training to do
    assert done.returncode == 2 and "summary " not in done.stdout
    assert "(0:3, 6:8) do not tile blocks 0:8" in done.stderr
    assert "--block_indices" in done.stderr and "then rerun" in done.stderr


def _fake_trainer(model_dir: Path, run_id: str) -> SimpleNamespace:
    embedding, head = load_client_parts(model_dir)
    for module in (embedding, head):
        module.requires_grad_(True)
    part = PartOptimizer(unique_parameters(embedding, head), OptimConfig(lr=1e-2))
    return SimpleNamespace(client=SimpleNamespace(embedding=embedding, head=head), part=part, steps_done=0,
                           run_id=run_id)


def test_trainer_state_round_trip(llama_dir, tmp_path):
    trainer = _fake_trainer(llama_dir, "round-trip")
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        trainer.part.add([torch.randn(p.shape, generator=gen) for p in trainer.part.params])
        trainer.part.step()
        trainer.steps_done += 1
    path = save_trainer_state(trainer, tmp_path / "trainer", {"micro_batches_drawn": 12})

    fresh = _fake_trainer(llama_dir, "round-trip")
    info = load_trainer_state(fresh, path)
    assert info["micro_batches_drawn"] == 12 and fresh.steps_done == 3 and fresh.part.step_count == 3
    for mine, theirs in zip(trainer.part.params, fresh.part.params, strict=True):
        assert torch.equal(mine, theirs)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(trainer.part.optimizer.state[mine][key], fresh.part.optimizer.state[theirs][key])
    # both continue identically
    grads = [torch.randn(p.shape, generator=gen) for p in trainer.part.params]
    for t in (trainer, fresh):
        t.part.add(grads)
        t.part.step()
    assert all(torch.equal(a, b) for a, b in zip(trainer.part.params, fresh.part.params, strict=True))

    with pytest.raises(ValueError, match="run_id"):
        load_trainer_state(_fake_trainer(llama_dir, "another-run"), path)
