"""``benchmarks/fuzz_peer.py``, bounded: 300 fuzzed messages against a live peer, which keeps serving correct
results, stays within its memory, closes the stream of a frame that declares 2^40 bytes, and logs no traceback."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "fuzz_peer.py"
_spec = importlib.util.spec_from_file_location("fuzz_peer", _PATH)
fuzz_peer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz_peer)


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    torch.manual_seed(0)
    return fuzz_peer.run(tmp_path_factory.mktemp("fuzz_peer"), messages=300, batch=100, streams=8, seed=1,
                         partial_frames=16)


def test_peer_survives_fuzzed_messages(result):
    assert result["messages_sent"] >= 300 and result["refused"] > 0.5 * result["replies"] > 0, result
    assert result["checks"] == result["correct_after"] >= 4, result  # forwards equal the local blocks' throughout
    assert result["peer_alive"] and result["tracebacks_in_log"] == 0 and result["internal_errors"] == 0, result
    assert result["stuck_streams"] == 0, result  # every stream we ended, the peer ended too
    assert result["oversized_frame_closed"] is True, result  # refused at its header, not buffered
    assert result["rss_max_mib"] - result["rss_start_mib"] < 64, result
    assert result["rss_partial_frames_closed_mib"] - result["rss_start_mib"] < 64, result  # released on close


@pytest.mark.skip(reason="open problem, for peers/framing.py: a frame's body has no deadline, so a stream that sends "
                         "all but the last byte of a frame of the largest size pins that much of the peer's memory for "
                         "as long as it stays open, and nothing bounds the number of such streams; enable once bounded")
def test_unfinished_frames_do_not_pin_memory(result):
    pinned = result["partial_frames"] * fuzz_peer.MAX_FRAME / (1 << 20)
    assert result["partial_frames_closed_by_peer"] == result["partial_frames"] or \
        result["rss_partial_frames_held_mib"] - result["rss_start_mib"] < pinned / 2, result
