"""peers/trainer: training through the swarm. Uses ``client``, ``training``, ``wire``.

- ``swarm_trainer.py``: ``SwarmTrainer``: remote autodiff through the stages, K micro-batches in flight, retries.
- ``chain.py``: a micro-batch as a chain (stages hand tensors to each other; each phase sent to all at once).
- ``pipeline.py``: choosing a run's stages, and waiting for a span whose peer is gone (e.g. restarting).
- ``replay.py``: a step replayed on a stage that did not apply it, so that no step is ever half-applied.
- ``state.py``: the trainer's own checkpoints; ``loop.py``: the progress-bar loop of ``swarm train``.
"""

from peers.trainer.swarm_trainer import SwarmTrainer

__all__ = ["SwarmTrainer"]
