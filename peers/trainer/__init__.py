"""peers/trainer: training through the swarm. Uses ``client``, ``training``, ``wire``.

- ``swarm_trainer.py``: ``SwarmTrainer``: remote autodiff through the stages, K micro-batches in flight, retries.
- ``state.py``: the trainer's own checkpoints; ``loop.py``: the progress-bar loop of ``swarm train``.
"""

from peers.trainer.swarm_trainer import SwarmTrainer

__all__ = ["SwarmTrainer"]
