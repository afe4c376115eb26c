"""peers/cli: the ``swarm`` command. Uses every room below it.

- ``commands.py``: the parser and the peer, dht, status and generate commands; ``options.py``: options every command
  shares (swarm flags) and how they map onto the config dataclasses.
- ``membership.py`` (keygen, identity, invite, revoke), ``new_model.py`` (new-model), ``train.py`` (train).
- ``status.py``: the swarm status table.
- ``launch.py``: start/stop real peer processes (demo, tests, benchmarks).
- ``demo.py``: ``swarm demo``, a whole local swarm with no arguments.
"""

from peers.cli.commands import main

__all__ = ["main"]
