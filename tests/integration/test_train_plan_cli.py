"""``swarm train CONFIG --plan``: the trainer is its run's broker from the command line. Two peers whose spans do
not tile the model move to its signed plan (one pipeline of two stages), and the run trains on them."""

from __future__ import annotations

import json

from peers.cli.launch import LocalSwarm


def test_swarm_train_plan_moves_the_peers_and_trains(fresh_swarm: LocalSwarm, llama_dir, tmp_path, swarm_cli):
    four = ["--max_blocks", "4"]  # 8 blocks, 2 peers of 4: one pipeline, and 0:3 + 5:8 leave 3:5 to nobody
    procs = [fresh_swarm.start_peer(llama_dir, block_indices=span, name=name, wait=False, extra=four)
             for name, span in (("a", "0:3"), ("b", "5:8"))]
    for proc in procs:
        fresh_swarm.wait_ready(proc)
    config = tmp_path / "planned.toml"
    config.write_text(f'model_dir = "{llama_dir}"\nseq_len = 16\nbatch_size = 4\nmicro_batch = 2\nin_flight = 2\n'
                      'steps = 2\nseed = 0\n[optim]\nlr = 3e-3\nwarmup_steps = 1\nschedule = "constant"\n')
    done = swarm_cli("train", str(config), "--plan", "--initial_peers", *fresh_swarm.initial_peers,
                     *fresh_swarm.trainer_flags(), "--eval_windows", "2", "--eval_every", "0", "--wait_peers", "90")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    summary = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("summary "))[8:])
    assert summary["run_id"] == "planned" and summary["steps_done"] == 2, summary
    assert set(summary["utilisation"]) == {"0:4", "4:8"}, summary  # the plan's stages, not the peers' first spans
    assert "Run planned: the plan v0" in done.stderr, done.stderr[-3000:]  # planned and published
    for proc in procs:  # each peer followed the trainer's plan and moved
        log = proc.log()
        assert "Following plan v0" in log and "Moving to blocks" in log, log[-2000:]
