"""peers/core: what every room of the node shares; imports nothing else of ``peers``.

- ``config.py``: ``SwarmConfig``, ``StageServerConfig``, ``ClientConfig`` (keyword-only, validated).
- ``trainers.py``: who may train a peer (``--trainers``).
- ``access.py``: a node's identity and admission (public swarm, or private with ``--private``) from its config.
- ``ids.py``: short peer ids for logs and messages, safe run names, the one dtype map.
- ``aio.py``: a background event loop for synchronous callers, and a task-free deadline.
- ``finite.py``: a cheap exact NaN/inf check for gradients and hidden states.
"""
