"""peers: the node runtime. Uses ``swarm`` (discovery, routing) and ``privacy``.

In data-flow order:

- ``config.py``: ``SwarmConfig``, ``StageServerConfig``, ``ClientConfig`` (keyword-only, validated).
- ``model/``: our block code for the Llama family and GPT-2, checkpoint loading of one stage's tensors.
- ``protocol.py``: typed messages and the ``StageService`` RPC declarations shared by server and client.
- ``backend.py``: ``StageBackend`` holds a stage's blocks and batches concurrent requests into one forward.
- ``handler.py``: ``StageHandler`` parses, validates, computes and serializes each RPC.
- ``server.py``: ``StageServer``, the composition root of a peer (DHT node, blocks, handler, announcer).
- ``aio.py``: a background event loop that gives synchronous code (the client) an async runtime.
- ``client.py``: ``SwarmClient`` runs embeddings and head locally and the blocks through a chain of peers.
- ``status.py``: the swarm status table.
- ``demo.py``: ``swarm demo``, a whole local swarm with no arguments.
- ``cli.py``: the ``swarm`` command; maps flags onto the config dataclasses, nothing more.
"""

__version__ = "0.1.0"

from peers.config import ClientConfig, StageServerConfig, SwarmConfig  # noqa: E402

__all__ = ["ClientConfig", "StageServerConfig", "SwarmConfig", "__version__"]
