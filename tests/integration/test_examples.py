"""The examples run end to end as a newcomer would run them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_private_swarm_example(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "private_swarm.py"), "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "equal to the local model's tokens" in done.stdout
    assert "an outsider reads 0 records" in done.stdout
    assert "stopped every process" in done.stdout
