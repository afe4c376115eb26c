"""peers: the node runtime. Uses ``swarm`` (discovery, routing) and ``privacy``.

Its rooms, lowest first; a room imports only rooms below it (``tests/unit/test_import_layers.py`` checks):

- ``core/``: config, who may train, identity and admission, ids, the background loop, a finiteness check.
- ``model/``: our block code for the Llama family and GPT-2, checkpoint loading of one stage's tensors.
- ``training/``: the math of training (stage optimizer, schedule, data, corpus, one-process reference).
- ``wire/``: typed messages, tensors on the wire, framing, the service, a node's streams to peers.
- ``server/``: a stage peer: composition root, stream handler, KV caches, batching backend, training RPCs.
- ``client/``: ``SwarmClient``, inference sessions, generation, the retry policy. Never imports ``server``.
- ``trainer/``: ``SwarmTrainer``, its checkpoints and the progress-bar loop of ``swarm train``.
- ``cli/``: the ``swarm`` command, demo, status, launching real peer processes.
"""

__version__ = "0.1.0"

from peers.core.config import ClientConfig, StageServerConfig, SwarmConfig  # noqa: E402

__all__ = ["ClientConfig", "StageServerConfig", "SwarmConfig", "__version__"]
