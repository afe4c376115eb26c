"""``benchmarks/plan_testbed.py --quick``: on the three_sites testbed the planner's arrangement trains 2 steps, the
estimator prices it, and nothing of the testbed is left behind, even when the run fails or hangs (the benchmark is
stopped, and its testbed, found by the owner pid in the state files, removed)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from swarm.testbed.cleanup import cleanup_leftovers, leftovers, nothing_left
from swarm.testbed.state import all_states

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT = 600.0


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM (the testbed removes itself), then SIGKILL to the group of what is left."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_quick_run_trains_the_plan_and_cleans_up(tmp_path):
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    prefixes: set[str] = set()
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "plan_testbed.py"), "--quick",
                                 "--workdir", str(tmp_path / "work")], cwd=ROOT, stdout=stdout, stderr=stderr,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while proc.poll() is None and time.monotonic() < deadline:
            prefixes |= {s.prefix for s in all_states() if s.owner_pid == proc.pid}
            time.sleep(1.0)
    finally:
        _stop(proc)
        for prefix in prefixes:  # whatever a failed or killed run left (its owner is gone by now)
            cleanup_leftovers(prefix=prefix)
    assert proc.returncode == 0, err.read_text()[-4000:]
    assert prefixes, "the benchmark made no testbed"
    assert all(nothing_left(leftovers(prefix)) for prefix in prefixes)
    result = json.loads(out.read_text())
    assert result["quick"] and result["nothing_left"] is True and list(result["matrices"]) == ["three_sites"]
    matrix = result["matrices"]["three_sites"]
    assert "failed" not in matrix, matrix.get("failed")
    [run] = matrix["runs"]["plan"]
    assert len(run["step_seconds"]) == 2 and all(math.isfinite(loss) for loss in run["losses"]), run
    assert run["tokens_per_s"] > 0 and run["estimated_tokens_per_s"] > 0, run
    assert run["pipeline"] and run["plan"]["groups"], run  # the planner's group it trained on
    print(json.dumps({"benchmark_s": result["seconds"], "peers_start_s": run["peers_start_s"]}))
