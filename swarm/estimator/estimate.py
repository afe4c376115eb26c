"""Per-token latency (inference) and tokens/s (training) of a candidate pipeline, along the data path of the code.

``star`` (today's code, ``peers.client``): the client sends the hidden states to stage 1, gets its output back,
sends that to stage 2, ... Training (``peers.trainer``) does the same per micro-batch, then the head and loss on the
trainer, then each stage's backward in reverse, up to ``in_flight`` micro-batches at once; each stage serves its
one stream's requests in order. A step ends with a commit: ``train_apply`` to every stage at once, then the
trainer's own optimizer step; the next step starts after it (two-phase steps: a fill and a drain per step).
``chain`` (the next issue's data path): the client sends to stage 1, each stage pushes its output to the next, the
last returns to the client; backward from the trainer to the last stage and down the chain to the first, whose
input gradient returns to the trainer. The commit still goes from the trainer to every stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from swarm.estimator.events import Step, Use, Wait, run, total
from swarm.estimator.inputs import CLIENT, LOOPBACK_STREAM, ModelShape, Pipeline, Stage, StreamCost


@dataclass(frozen=True)
class StageTime:
    """One stage's compute for one call (a token step, or a micro-batch)."""

    peer: str
    start: int
    end: int
    forward_s: float
    backward_s: float = 0.0
    apply_s: float = 0.0


@dataclass(frozen=True)
class Transfer:
    """One message on one directed link: its bytes (tensor after the codec, plus framing) and its seconds on the
    link (bytes at the slower of the link and the daemons; latency and transit not included)."""

    src: str
    dst: str
    direction: str  # "forward" (hidden states), "backward" (gradients) or "commit"
    bytes: float
    seconds: float


@dataclass(frozen=True)
class InferenceEstimate:
    token_latency_s: float  # one generation step of ``tokens`` new tokens, end to end
    tokens_per_s: float  # batch * tokens / token_latency_s, for one session
    compute_s: float  # the stages' compute
    client_s: float  # the client's own embedding, head and sampling
    link_s: float  # bytes on the links
    latency_s: float  # the links' one-way latencies
    stream_s: float  # serialization, sealing, the p2p daemons, Python: per message
    stages: tuple[StageTime, ...]
    transfers: tuple[Transfer, ...]


@dataclass(frozen=True)
class TrainingEstimate:
    tokens_per_s: float
    step_s: float  # micro-batches + commit
    micro_batches_s: float  # the step's micro-batches, from the first embedding to the last input gradient
    commit_s: float  # train_apply on every stage and the trainer's optimizer step
    micro_batch_latency_s: float  # one micro-batch alone through the pipeline (K = 1: a step is M of these)
    bottleneck: str  # the resource held longest per step ("stage:PEER", "client", "link:SRC->DST")
    busy_s: dict[str, float]  # seconds each resource is held per step
    stages: tuple[StageTime, ...]
    transfers: tuple[Transfer, ...]  # one micro-batch's messages (the commit's are in ``commit``)
    cut_bytes: tuple[tuple[float, float], ...]  # per block boundary: (forward, backward) bytes per micro-batch


class _Path:
    """Builds the steps of one job (a token step or a micro-batch) along a pipeline."""

    def __init__(self, model: ModelShape, pipeline: Pipeline, stream: StreamCost) -> None:
        self.model, self.pipeline, self.stream = model, pipeline, stream
        self.steps: list[Step] = []  # each cost on its own (for the breakdowns)
        self.transfers: list[Transfer] = []

    def job(self) -> list[Step]:
        """The steps as the resources see them: back-to-back uses of one resource are one hold (a peer reads a
        request, computes and writes its reply before it reads the next; the client reads a reply and sends it on
        in one turn of its loop), so no other job's work comes between them."""
        merged: list[Step] = []
        for step in self.steps:
            last = merged[-1] if merged else None
            if isinstance(step, Use) and isinstance(last, Use) and last.resource == step.resource:
                merged[-1] = Use(step.resource, last.seconds + step.seconds, last.kind, last.core or step.core)
            elif isinstance(step, Wait) and step.seconds == 0:
                continue
            else:
                merged.append(step)
        return merged

    def cpu(self, who: str, seconds: float, kind: str) -> None:
        self.steps.append(Use(_resource(who), seconds, kind, core=True))

    def message(self, src: str, dst: str, elements: int, direction: str, work: float = 0.0,
                kind: str = "compute") -> None:
        """A message of ``elements`` from ``src`` to ``dst``: the sender's CPU, the link, the receiver's CPU and
        then ``work`` seconds of the receiver's (its compute, on the same loop/thread)."""
        link = self.pipeline.link(src, dst)
        codec = link.codec or self.pipeline.codec
        nbytes = (codec.encoded_bytes(elements, self.model.dtype_bytes) if elements else 0.0) + self.stream.frame_bytes
        codec_s = elements * codec.cpu_s_per_element / 2
        seconds = nbytes / min(link.payload_rate, self.stream.daemon_rate)
        self.transfers.append(Transfer(src, dst, direction, nbytes, seconds))
        self.cpu(src, self.stream.send(nbytes) + codec_s, "stream")
        self.steps.append(Use(_link_resource(src, dst, link.shared), seconds, "link"))
        self.steps.append(Wait(link.latency, "latency"))
        self.steps.append(Wait(self.stream.transit_s, "stream"))
        self.cpu(dst, self.stream.recv(nbytes) + codec_s, "stream")
        if work:
            self.cpu(dst, work, kind)


def _resource(who: str) -> str:
    return "client" if who == CLIENT else f"stage:{who}"


def _link_resource(src: str, dst: str, shared: str | None) -> str:
    return f"link:{shared}" if shared else f"link:{src}->{dst}"


def estimate_inference(model: ModelShape, pipeline: Pipeline, *, batch: int = 1, tokens: int = 1,
                       stream: StreamCost = LOOPBACK_STREAM) -> InferenceEstimate:
    """One generation step of ``tokens`` new tokens for ``batch`` rows (``tokens=1``: the per-token latency)."""
    pipeline.check(model)
    if batch < 1 or tokens < 1:
        raise ValueError(f"batch and tokens must be >= 1, got {batch} and {tokens}")
    elements = batch * tokens * model.hidden_size
    rows = batch * tokens
    stages = tuple(StageTime(s.peer, s.start, s.end, s.compute.forward(rows, s.blocks)) for s in pipeline.stages)
    path = _Path(model, pipeline, stream)
    client = pipeline.client
    path.cpu(CLIENT, client.fixed_s + rows * client.forward_s, "client")
    peers = [s.peer for s in pipeline.stages]
    if pipeline.topology == "star":
        for stage, time in zip(peers, stages, strict=True):
            path.message(CLIENT, stage, elements, "forward", time.forward_s)
            path.message(stage, CLIENT, elements, "forward")
    else:
        route = [CLIENT, *peers]
        works = [t.forward_s for t in stages]
        for i, stage in enumerate(peers):
            path.message(route[i], stage, elements, "forward", works[i])
        path.message(peers[-1], CLIENT, elements, "forward")
    steps = path.steps
    latency = total(steps)
    return InferenceEstimate(
        token_latency_s=latency, tokens_per_s=rows / latency, compute_s=total(steps, "compute"),
        client_s=total(steps, "client"), link_s=total(steps, "link"), latency_s=total(steps, "latency"),
        stream_s=total(steps, "stream"), stages=stages, transfers=tuple(path.transfers),
    )


def estimate_training(model: ModelShape, pipeline: Pipeline, *, rows: int, seq_len: int, micro_batches: int,
                      in_flight: int, recompute: bool = False, stream: StreamCost = LOOPBACK_STREAM,
                      cores: int | None = None) -> TrainingEstimate:
    """One training step of ``micro_batches`` micro-batches of ``rows x seq_len`` tokens, ``in_flight`` at once.

    ``cores``: the client and every stage share that many CPU cores (hosts emulated on one machine, like the
    testbed); None: each has its own machine."""
    pipeline.check(model)
    for name, value in (("rows", rows), ("seq_len", seq_len), ("micro_batches", micro_batches),
                        ("in_flight", in_flight)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    tokens = rows * seq_len
    elements = tokens * model.hidden_size
    stages = tuple(StageTime(s.peer, s.start, s.end, s.compute.forward(tokens, s.blocks),
                             s.compute.backward(tokens, s.blocks, recompute), s.compute.apply_s * s.blocks)
                   for s in pipeline.stages)
    micro = _micro_batch(model, pipeline, stream, stages, elements, tokens, recompute)
    phase = run([micro.job()] * micro_batches, in_flight, cores)
    commit = _commit(model, pipeline, stream, stages)
    commit_run = run(commit, len(commit), cores)
    client_apply = pipeline.client.apply_s
    busy = dict(phase.busy)
    for resource, seconds in commit_run.busy.items():
        busy[resource] = busy.get(resource, 0.0) + seconds
    busy["client"] = busy.get("client", 0.0) + client_apply
    step = phase.makespan + commit_run.makespan + client_apply
    bottleneck = max(busy, key=lambda r: busy[r])
    grad_elements = 2 * elements if recompute else elements
    cuts = tuple((_bytes(model, pipeline, elements), _bytes(model, pipeline, grad_elements))
                 for _ in pipeline.stages[1:])
    return TrainingEstimate(
        tokens_per_s=micro_batches * tokens / step, step_s=step, micro_batches_s=phase.makespan,
        commit_s=commit_run.makespan + client_apply, micro_batch_latency_s=total(micro.steps), bottleneck=bottleneck,
        busy_s=busy, stages=stages, transfers=tuple(micro.transfers), cut_bytes=cuts,
    )


def _bytes(model: ModelShape, pipeline: Pipeline, elements: int) -> float:
    return pipeline.codec.encoded_bytes(elements, model.dtype_bytes)


def _micro_batch(model: ModelShape, pipeline: Pipeline, stream: StreamCost, stages: tuple[StageTime, ...],
                 elements: int, tokens: int, recompute: bool) -> _Path:
    path = _Path(model, pipeline, stream)
    client = pipeline.client
    peers = [s.peer for s in pipeline.stages]
    grad_in = 2 * elements if recompute else elements  # a recompute backward also carries the stage's input
    turn = client.fixed_s + tokens * (client.forward_s + client.backward_s)  # head, loss and their backward
    if pipeline.topology == "star":
        for stage, time in zip(peers, stages, strict=True):
            path.message(CLIENT, stage, elements, "forward", time.forward_s)
            path.message(stage, CLIENT, elements, "forward")
        path.cpu(CLIENT, turn, "client")
        for stage, time in zip(reversed(peers), reversed(stages), strict=True):
            path.message(CLIENT, stage, grad_in, "backward", time.backward_s)
            path.message(stage, CLIENT, elements, "backward")
    else:
        route = [CLIENT, *peers]
        for i, (stage, time) in enumerate(zip(peers, stages, strict=True)):
            path.message(route[i], stage, elements, "forward", time.forward_s)
        path.message(peers[-1], CLIENT, elements, "forward")
        path.cpu(CLIENT, turn, "client")
        back = [CLIENT, *reversed(peers)]
        for i, (stage, time) in enumerate(zip(reversed(peers), reversed(stages), strict=True)):
            path.message(back[i], stage, grad_in, "backward", time.backward_s)
        path.message(peers[0], CLIENT, elements, "backward")
    return path


def _commit(model: ModelShape, pipeline: Pipeline, stream: StreamCost, stages: tuple[StageTime, ...]
            ) -> list[list[Step]]:
    """``train_apply`` to every stage at once: a small message each way and the stage's optimizer step."""
    jobs = []
    for stage, time in zip(pipeline.stages, stages, strict=True):
        _need_commit_links(pipeline, stage)
        path = _Path(model, pipeline, stream)
        path.message(CLIENT, stage.peer, 0, "commit", time.apply_s)
        path.message(stage.peer, CLIENT, 0, "commit")
        jobs.append(path.job())
    return jobs


def _need_commit_links(pipeline: Pipeline, stage: Stage) -> None:
    for pair in ((CLIENT, stage.peer), (stage.peer, CLIENT)):
        if pair not in pipeline.links:
            raise ValueError(f"no link {pair[0]} -> {pair[1]}: the trainer commits each step on every stage "
                             f"directly; add links[{pair!r}]")
