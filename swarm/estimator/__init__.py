"""The workload estimator: pure functions from a model's shape and a candidate pipeline to its costs.

- ``inputs``: ``ModelShape``, a peer's measured ``Compute``, the client's ``ClientCompute``, ``Link`` (bits/s,
  latency, shared uplinks, a per-direction ``Codec``), ``StreamCost`` (per-message costs of our stream, measured on
  127.0.0.1), ``Stage`` and ``Pipeline`` (``star``: today's data path; ``chain``: the next one).
- ``estimate``: ``estimate_inference`` (per-token latency) and ``estimate_training`` (tokens/s with K micro-batches
  in flight, two-phase steps), with each stage's compute, each message's bytes and link time.
- ``from_records``: ``pipeline_from_records`` prices a pipeline of real peers from their records and link tables.
- ``events``: the first-come-first-served discrete-event run behind ``estimate_training``.
"""

from swarm.estimator.estimate import (
    InferenceEstimate,
    StageTime,
    TrainingEstimate,
    Transfer,
    estimate_inference,
    estimate_training,
)
from swarm.estimator.inputs import (
    CLIENT,
    LOOPBACK_STREAM,
    NO_CODEC,
    TCP_PAYLOAD_FRACTION,
    ClientCompute,
    Codec,
    Compute,
    Link,
    ModelShape,
    Pipeline,
    Stage,
    StreamCost,
)

__all__ = [
    "CLIENT", "LOOPBACK_STREAM", "NO_CODEC", "TCP_PAYLOAD_FRACTION", "ClientCompute", "Codec", "Compute",
    "InferenceEstimate", "Link", "ModelShape", "Pipeline", "Stage", "StageTime", "StreamCost", "TrainingEstimate",
    "Transfer", "estimate_inference", "estimate_training",
]
