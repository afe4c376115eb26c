"""``benchmarks/fuzz_peer.py``, bounded: 300 fuzzed messages against a live peer, which keeps serving correct
results, stays within its memory, closes the stream of a frame that declares 2^40 bytes, and logs no traceback."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "fuzz_peer.py"
_spec = importlib.util.spec_from_file_location("fuzz_peer", _PATH)
fuzz_peer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz_peer)


def test_peer_survives_fuzzed_messages(tmp_path):
    torch.manual_seed(0)
    result = fuzz_peer.run(tmp_path, messages=300, batch=100, streams=8, seed=1)
    assert result["messages_sent"] >= 300 and result["refused"] > 0.5 * result["replies"] > 0, result
    assert result["checks"] == result["correct_after"] >= 4, result  # forwards equal the local blocks' throughout
    assert result["peer_alive"] and result["tracebacks_in_log"] == 0 and result["internal_errors"] == 0, result
    assert result["stuck_streams"] == 0, result  # every stream we ended, the peer ended too
    assert result["oversized_frame_closed"] is True, result  # refused at its header, not buffered
    assert result["rss_max_mib"] - result["rss_start_mib"] < 64, result
