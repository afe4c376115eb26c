"""peers: the node runtime. Uses ``swarm`` (discovery, routing) and ``privacy``.

In data-flow order:

- ``config.py``: ``SwarmConfig``, ``StageServerConfig``, ``ClientConfig`` (keyword-only, validated).
- ``model/``: our block code for the Llama family and GPT-2, checkpoint loading of one stage's tensors.
- ``protocol.py``: typed messages and the ``StageService`` RPC declarations shared by server and client.
- ``sessions.py``: server-side inference sessions (KV caches) within a peer's cache budget.
- ``backend.py``: ``StageBackend`` holds a stage's blocks and batches concurrent requests into one forward.
- ``access.py``: a node's identity and admission (public swarm, or private with ``--private``) from its config.
- ``inference_rpc.py``: the peer's side of its one stream per client: hello (handshake + admission), forwards,
  inference sessions (open, steps of many sessions, close) and, through ``training_rpc.py``, training calls.
- ``training_rpc.py``: a peer's training: open a run, forward/backward micro-batches, two-phase apply,
  checkpoints, and replica parameters; ``averaging.py``: replicas average every H steps (DiLoCo-style).
- ``training/``: the math of training (stage optimizer, schedule, data, corpus, one-process reference).
- ``handler.py``: ``StageHandler`` parses, validates, computes and serializes each RPC.
- ``server.py``: ``StageServer``, the composition root of a peer (DHT node, blocks, handler, announcer).
- ``aio.py``: a background event loop for synchronous callers, and a task-free deadline.
- ``peer_stream.py``: the client's one stream per peer, which sends concurrent sessions' steps together;
  ``peer_links.py``: a peer's own streams to other peers (replica averaging, late joiners).
- ``session.py``: ``InferenceSession``: steps through a chain of peers, replay onto replacements.
- ``generation.py``: sampling and the token loop; ``textgen.py``: text in, text out.
- ``client.py``: ``SwarmClient``: embeddings and head locally, blocks through the swarm.
- ``trainer.py``: ``SwarmTrainer``: remote autodiff through the stages, K micro-batches in flight, retries;
  ``trainer_state.py``: the trainer's own checkpoints; ``train_loop.py``: the progress-bar loop of ``swarm train``.
- ``finite.py``: a cheap exact NaN/inf check for gradients and hidden states.
- ``status.py``: the swarm status table.
- ``launch.py``: start/stop real peer processes (demo, tests, benchmarks).
- ``demo.py``: ``swarm demo``, a whole local swarm with no arguments.
- ``cli.py``: the ``swarm`` command; maps flags onto the config dataclasses, nothing more; ``cli_membership.py``
  (keygen, identity, invite, revoke), ``cli_model.py`` (new-model) and ``cli_train.py`` (train) are its
  subcommand groups.
"""

__version__ = "0.1.0"

from peers.config import ClientConfig, StageServerConfig, SwarmConfig  # noqa: E402

__all__ = ["ClientConfig", "StageServerConfig", "SwarmConfig", "__version__"]
