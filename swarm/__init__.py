"""swarm: knows peers and plans; contains no model code. Depends only on ``privacy``.

In data-flow order:

- ``records.py``: ``PeerRecord`` and ``PeerState``, typed and validated, with ``to_wire()``/``from_wire()``.
- ``keys.py``: every DHT key and subkey format.
- ``discovery.py``: ``announce()`` and ``fetch_records()``, the code that reads and writes peer records.
- ``revocations.py``: a private swarm's revocations, spread through the DHT and applied (records purged).
- ``announcer.py``: the heartbeat that re-announces a peer's record before it expires.
- ``measure.py``: the compute benchmark of one block, cached on disk.
- ``block_selection.py``: which blocks a joining peer should serve (the least-served window). Pure.
- ``routing.py``: ``make_chain()`` picks a chain of peers covering a block range, and ``Router`` owns bans.
- ``stages.py``: a training pipeline: whole spans that tile the model, replicas grouped, micro-batches spread.
"""
