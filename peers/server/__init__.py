"""peers/server: a stage peer. Uses ``wire``, ``model``, ``training``, ``core``; never ``client``.

In data-flow order:

- ``stage_server.py``: ``StageServer``, the composition root (DHT node, blocks, handler, announcer), and its moves:
  ``move_to(start, end)`` (load while serving, then switch), ``become_backup()``, ``span``;
  ``control.py``: the operator's local control socket (``move START:END`` / ``backup`` lines, ``swarm move``);
  ``memory.py``: how many blocks free memory holds (``--max_blocks``' default).
- ``handler.py``: ``StageHandler``: ``rpc_info`` and the stream's handle; request validation.
- ``stream_handler.py``: one client's stream: hello (handshake + admission), then each request to its handler.
- ``kv_sessions.py``: inference sessions (KV caches) within the cache budget, a fair share per client.
- ``backend.py``: ``StageBackend`` holds the blocks and batches concurrent requests into one forward.
- ``training_rpc.py``: a peer's training (open, forward/backward, two-phase apply, checkpoints, parameters);
  ``training_chain.py``: training as a chain (pushes from/to the adjacent stages, deferred chained requests);
  ``averaging.py``: replicas average every H steps (DiLoCo-style).
"""

from peers.server.stage_server import StageServer

__all__ = ["StageServer"]
