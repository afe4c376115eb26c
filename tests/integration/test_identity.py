"""A peer started with --identity_path keeps its peer id across restarts, and the id is its public key."""

from __future__ import annotations

import os
import signal

from privacy.identity import Identity
from privacy.peer_ids import peer_id_of


def test_identity_file_fixes_the_peer_id(fresh_swarm, llama_dir, tmp_path):
    path = tmp_path / "peer.key"
    first = fresh_swarm.start_peer(llama_dir, block_indices="0:8", extra=["--identity_path", str(path)])
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert first.peer_id == peer_id_of(Identity.load(path).public_bytes)
    os.kill(first.pid, signal.SIGTERM)
    assert first.popen.wait(20) == 0
    again = fresh_swarm.start_peer(llama_dir, block_indices="0:8", extra=["--identity_path", str(path)])
    assert again.peer_id == first.peer_id
