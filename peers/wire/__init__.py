"""peers/wire: what a client and a peer say to each other, and the streams that carry it. Uses ``core``.

In data-flow order:

- ``values.py``: element-wise checks of msgpack values against field types (``list[str]``, bounded ints, ...).
- ``messages.py``: the typed messages of the stream (hello, forward, sessions, training calls, replies).
- ``errors.py``: refusals: ``RequestError``, not admitted (final), capacity (retry elsewhere, not a failure).
- ``tensors.py``: tensors serialized, sealed, split into chunk messages and read back with a size limit.
- ``framing.py``: frames of a stream read with a size cap on arrival, a deadline-safe reader, whole-frame writes.
- ``service.py``: the peer's unary RPC, its stream's handle, heartbeats.
- ``stream.py``: ``PeerStream``, a node's one stream to one peer (concurrent steps coalesced, heartbeats watched).
- ``links.py``: ``PeerLinks``, a node's streams to other peers, opened on first use and reopened once broken.
"""
