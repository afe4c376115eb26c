"""``python -m peers.cli``: the ``swarm`` command."""

import sys

from peers.cli.commands import main

sys.exit(main())
