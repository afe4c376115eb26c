"""``swarm monitor``: a live web map of a swarm (``snapshot``: its data, ``page``: its HTML, ``app``: the server)."""
