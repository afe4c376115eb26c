"""peers/client: running a model through the swarm. Uses ``wire``, ``model``, ``core``; never ``server``.

In data-flow order:

- ``swarm_client.py``: ``SwarmClient``: embeddings and head here, blocks through a chain of peers.
- ``node.py``: ``ClientNode``, the ``Protocol`` of what sessions and generation need from a client.
- ``retry.py``: the one retry policy: which errors are final, capacity or failures; backoff.
- ``inference_session.py``: ``InferenceSession``: steps through a chain of peers, replay onto replacements.
- ``generation.py``: sampling and the token loop; ``textgen.py``: text in, text out.
"""

from peers.client.swarm_client import SwarmClient

__all__ = ["SwarmClient"]
