"""``benchmarks/slow_links.py --quick``: a tiny model trains 2 steps over the emulated slow link in chain topology;
the run's final weights come back from its checkpoints, and nothing of the testbed is left behind."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_quick_run_trains_evaluates_and_cleans_up(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "slow_links.py"), "--quick", "--workdir",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    assert result["nothing_left"] is True
    run = result["runs"]["none/0"]
    assert run["steps_done"] == 2 and run["stage_checkpoint_steps"] == [2, 2, 2], run
    assert run["tokens"] == result["tokens_per_run"] and run["tokens_per_s"] > 0, run
    assert math.isfinite(run["held_out_loss"]) and run["held_out_loss"] < result["held_out_loss_initial"], result
    assert run["slow_link_MB"]["h1->h2"] > 0, run  # the hidden states crossed the shaped link
    other = result["runs"]["adaptive/0"]
    assert "tokens_per_s" in other or "not available" in other.get("skipped", ""), other
