"""Typed messages of the peer stream: dataclasses packed with msgpack and checked field by field on arrival
(lists element by element, see ``peers.wire.values``); ``pack_inference``/``unpack_inference`` add and read
the kind."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, TypeVar, get_type_hints

import msgpack

from peers.wire.values import Mismatch, conform, type_name, unpack_map

M = TypeVar("M", bound="Message")


class Message:
    """A dataclass that packs to msgpack bytes and checks every field's type when unpacked (``ValueError`` if
    malformed; lists element by element, see ``peers.wire.values``)."""

    _fields: ClassVar[dict[type, list[tuple[str, Any, bool]]]] = {}  # per class: (name, type, required)

    @classmethod
    def _schema(cls) -> list[tuple[str, Any, bool]]:
        schema = Message._fields.get(cls)
        if schema is None:  # get_type_hints is slow: once per class, not per message
            hints = get_type_hints(cls)
            schema = [
                (f.name, hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                for f in dataclasses.fields(cls)
            ]
            Message._fields[cls] = schema
        return schema

    def to_bytes(self) -> bytes:
        return msgpack.packb({name: getattr(self, name) for name, _, _ in self._schema()}, use_bin_type=True)

    @classmethod
    def from_bytes(cls: type[M], data: bytes) -> M:
        return cls.from_map(unpack_map(data, cls.__name__))

    @classmethod
    def from_map(cls: type[M], raw: dict) -> M:
        """The message from an unpacked msgpack map; unknown keys are ignored (fields of newer versions)."""
        kwargs = {}
        for name, expected, required in cls._schema():
            if name not in raw:
                if required:
                    raise ValueError(f"malformed {cls.__name__}: missing field {name!r}")
                continue
            try:
                kwargs[name] = conform(raw[name], expected)
            except Mismatch:
                raise ValueError(f"malformed {cls.__name__}: field {name!r} must be {type_name(expected)}") from None
        return cls(**kwargs)


@dataclasses.dataclass(frozen=True)
class InfoRequest(Message):
    """Ask a peer what it serves; ``proof`` is the caller's admission proof (empty in a public swarm)."""

    proof: bytes = b""


@dataclasses.dataclass(frozen=True)
class ForwardRequest(Message):
    """On a stream: run the message's hidden states through blocks ``[start, end)`` (no cache, no session)."""

    start: int
    end: int
    compression: str = ""  # the codec of the request's tensor, for the reply's (``swarm.compression``; "": none)
    adapter: str = ""  # LoRA adapters to run with, for this request only (``InferenceOpen.adapter``)


@dataclasses.dataclass(frozen=True)
class InferenceOpen(Message):
    """Open a session on this stream (or, with ``resume``, re-attach a detached one of the same client)."""

    session_id: str  # random, chosen by the client; bound to the client's peer id
    start: int
    end: int
    max_length: int  # tokens the session may hold (prompt + new tokens)
    batch_size: int
    resume: bool = False
    # the chain (``peers.server.chain_calls``): who pushes this session's inputs ("" = the client, in its steps) and
    # where its outputs go ("" = back to the client in the step replies; else pushed to that peer's session)
    upstream: str = ""
    downstream: str = ""
    downstream_session: str = ""
    # how the peer sends this session's outputs, to the client and pushed downstream (``swarm.compression`` codec
    # text, e.g. "fp16"; "": none, bit-exact)
    compression: str = ""
    # LoRA adapters this session runs with (this session only): the run id of the caller's own adapter run on this
    # peer, or the ``AdapterLoad.name`` of adapters the caller loaded here; "": the base model
    adapter: str = ""


@dataclasses.dataclass(frozen=True)
class AdapterLoad(Message):
    """Load LoRA adapters (e.g. an exported ``peft`` folder's) for the caller's own sessions and forwards on blocks
    ``[start, end)``: the message's tensor holds the values of ``names`` (``LoraAdapter`` state names), in order;
    requests name them ``name``. They stay until the peer restarts or needs the room."""

    name: str
    spec: str  # ``peers.training.lora`` spec text
    start: int
    end: int
    names: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class InferenceStep(Message):
    """Steps of one or more sessions of this stream; their rows are concatenated in one tensor, in order.

    Each session's tokens start at its ``positions[i]``; a position below the session's length rolls its
    cache back to it. All parts have the same number of new tokens.
    """

    session_ids: list[str]
    positions: list[int]
    # a replay into a replacement (chain): compute and keep the outputs, push nothing downstream, return nothing
    hold: bool = False


@dataclasses.dataclass(frozen=True)
class InferencePush(Message):
    """Chain: a peer's outputs for sessions of the next peer (the tensor: their rows, concatenated in order), pushed
    peer to peer. Accepted only from each session's named upstream; the reply acks it (``errors`` per part)."""

    session_ids: list[str]
    positions: list[int]
    rows: list[int]  # each part's rows of the tensor


@dataclasses.dataclass(frozen=True)
class InferenceRelink(Message):
    """Chain: the client re-routes around a failed peer: this session's upstream and/or downstream change. No reply;
    applied on arrival (also while a step of the session waits for its input)."""

    session_id: str
    set_upstream: bool = False
    upstream: str = ""  # "" = the client
    set_downstream: bool = False
    downstream: str = ""  # "" = the client
    downstream_session: str = ""


@dataclasses.dataclass(frozen=True)
class InferenceReplay(Message):
    """Chain recovery: push the outputs this session kept for positions ``[0, upto)`` to a new downstream session (a
    replacement of the failed next peer), which becomes the session's downstream."""

    session_id: str
    upto: int
    downstream: str
    downstream_session: str


@dataclasses.dataclass(frozen=True)
class InferenceClose(Message):
    """Free these sessions now, or with ``detach`` keep them (until the timeout) for a resume elsewhere."""

    session_ids: list[str]
    detach: bool = False


@dataclasses.dataclass(frozen=True)
class InferenceHello(Message):
    """First request of a stream: the client's handshake (``privacy.channel.ClientHandshake``; empty for a
    plaintext stream) and its admission proof (``privacy.admission``; empty in a public swarm)."""

    hello: bytes = b""
    proof: bytes = b""
    heartbeat: bool = False  # ask the peer for a heartbeat every HEARTBEAT_PERIOD s while it works on our requests


@dataclasses.dataclass(frozen=True)
class TrainOpen(Message):
    """Join training run ``run_id`` with this peer's blocks ``[start, end)`` (its whole span): the run's
    optimizer config (``peers.training.OptimConfig.to_dict()``) and micro-batches per optimizer step."""

    run_id: str
    start: int
    end: int
    optim: dict[str, Any]
    accumulation: int
    keep_activations: bool = True  # keep each micro-batch's graph until its backward (else recompute)
    checkpoint_every: int = 0  # save weights + AdamW state every N optimizer steps (0: never)
    replicas: list[str] = dataclasses.field(default_factory=list)  # peer ids of the run's other replicas of this span
    average_every: int = 0  # H: average parameters with the replicas every H local steps (0: never)
    outer_lr: float = 1.0  # DiLoCo outer step: Nesterov SGD on (anchor - average); lr 1, momentum 0 = plain mean
    outer_momentum: float = 0.0
    explicit_apply: bool = False  # step only on TrainApply (two-phase), not after `accumulation` backwards
    run_step: int = 0  # the run's optimizer steps so far: a replica that joins mid-run starts counting there
    # chain: the peers of the adjacent stages (all their replicas in this run) that may push to us; empty = the trainer
    upstream: list[str] = dataclasses.field(default_factory=list)
    downstream: list[str] = dataclasses.field(default_factory=list)
    # how this stage sends the run's tensors (``swarm.compression``): "none" (bit-exact), a codec ("fp16", "int8",
    # "topk:0.1/int8") or "adaptive" (per link and direction, from the measured link and the compute time)
    compression: str = "none"
    staleness: int = 0  # 1: asynchronous steps: forwards may name the weights before the last step (``at_step``)
    # a LoRA spec (``peers.training.lora``): the run trains its own adapters here, made from ``adapter_seed``, on the
    # frozen blocks (allowed by ``--adapters``); "" trains the blocks themselves (allowed by ``--trainers``)
    adapter: str = ""
    adapter_seed: int = 0
    # prompt tuning (``peers.training.prompts``): the blocks stay frozen (no step changes them); with ``deep_prompts``
    # each forward carries the stage's deep prompts (``TrainForward.prompt_shape``), each backward returns their grad
    prompts: int = 0
    deep_prompts: bool = False


@dataclasses.dataclass(frozen=True)
class TrainApply(Message):
    """Commit the step: apply the ``micro_batches`` accumulated since the last step (refused if any is missing)."""

    run_id: str
    micro_batches: int


@dataclasses.dataclass(frozen=True)
class ParamsPush(Message):
    """From a replica of the same span in run ``run_id``: its flat parameters for averaging round ``round``."""

    run_id: str
    round: int
    # compressed rounds (``peers.server.averaging_delta``): the digest of the anchor the tensor is a delta from;
    # "" = the tensor is the parameters themselves
    anchor: str = ""


@dataclasses.dataclass(frozen=True)
class ParamsFetch(Message):
    """Ask a peer for its current flat parameters of blocks ``[start, end)`` (a late replica joining, a peer moving,
    ``swarm export``); with ``run_id``, only if they are that training run's (else a refusal)."""

    start: int
    end: int
    run_id: str = ""


@dataclasses.dataclass(frozen=True)
class TrainForward(Message):
    """A training forward of micro-batch ``micro_id`` (the message's tensor: hidden states)."""

    run_id: str
    micro_id: str
    # chain: this micro-batch's neighbours on its route ("" = the trainer). With a peer upstream the request carries no
    # tensor (the input comes as a TrainPush); with a peer downstream the output is pushed there, not returned
    upstream: str = ""
    downstream: str = ""
    at_step: int = -1  # staleness 1: run on the weights of this stage's step count (now or before its last step)
    # compression: the codec of the output this request returns to the trainer ("" = the run's setting decides); the
    # trainer sets it under "adaptive", from its own measured link to this peer (the stage has no measure of it)
    reply_codec: str = ""
    # deep prompts: their shape [blocks, prompts, hidden]; they travel packed after the hidden states' rows
    # (``peers.training.prompts.pack``), and the backward's reply packs their grad after the input's the same way
    prompt_shape: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class TrainBackward(Message):
    """The backward of ``micro_id``: the tensor is the grad of its outputs, or with ``recompute`` the
    micro-batch's input and that grad stacked on a new first dim (stateless: the peer kept nothing)."""

    run_id: str
    micro_id: str
    recompute: bool = False
    # chain: "upstream" is the next stage (it pushes the grad of our output), "downstream" the previous one (it gets
    # the grad of our input); "" = the trainer
    upstream: str = ""
    downstream: str = ""
    # chain: the grads of a replica's share are scaled by accumulation / share (the trainer does it in a star): the
    # stage multiplies the grad it gets by ``scale`` and divides the grad of its input by it
    scale: float = 1.0
    reply_codec: str = ""  # as ``TrainForward.reply_codec``: for the grad of the input returned to the trainer


@dataclasses.dataclass(frozen=True)
class TrainPush(Message):
    """Chain: a stage's output (forward) or the grad of its input (``backward``) for micro-batch ``micro_id``, pushed to
    the next (previous) stage of the route; accepted only from the run's named neighbours."""

    run_id: str
    micro_id: str
    backward: bool = False


@dataclasses.dataclass(frozen=True)
class TrainFetch(Message):
    """Chain replay: the trainer asks a stage for a tensor it exchanged with another peer in the last step it applied
    (``what``: "input" it was pushed, "output" it pushed, "grad" of its input it pushed) for micro-batch ``micro_id``:
    what a stage that missed that step's commit needs to replay it (the trainer never saw it)."""

    run_id: str
    micro_id: str
    what: str


@dataclasses.dataclass(frozen=True)
class GraphOpen(Message):
    """Operator graphs (``peers.model.graph``): open training run ``run_id`` on this peer's stage, nodes ``[start,
    end)`` of architecture ``arch`` traced with hash ``graph_hash``; ``optim``: AdamW's lr, betas, eps, weight_decay."""

    run_id: str
    arch: str
    graph_hash: str
    start: int
    end: int
    optim: dict[str, Any] = dataclasses.field(default_factory=dict)
    # parameters this stage shares with another (a tied weight): each micro-batch's gradient of them is kept apart
    # (``GraphGrads``), so that the trainer adds the holders' parts in one process's order
    shared: list[str] = dataclasses.field(default_factory=list)
    checkpoint_every: int = 0  # a stage with a --checkpoint_dir saves the run every this many steps (0: never)
    # the run's other peers serving the same nodes (replicas): they average parameters and float buffers with this
    # one every ``average_every`` steps (``ParamsPush``, as transformer replicas do); ``source``: a replica whose
    # current weights this one copies when the run is new here, so that the replicas start equal
    replicas: list[str] = dataclasses.field(default_factory=list)
    average_every: int = 1
    source: str = ""


@dataclasses.dataclass(frozen=True)
class GraphForward(Message):
    """A forward of nodes ``[start, end)`` of graph ``graph_hash``: an edge bundle (``peers.wire.edges``) of the
    stage's input edges follows this message; the reply is the bundle of its output edges. ``run_id`` "": inference
    (eval mode, nothing kept); else a training forward of micro-batch ``micro_id``, kept until its backward."""

    arch: str
    graph_hash: str
    start: int
    end: int
    run_id: str = ""
    micro_id: str = ""
    compression: str = ""  # the codec of the bundles' floating-point edges both ways ("": none; ``edge_codec``)


@dataclasses.dataclass(frozen=True)
class GraphBackward(Message):
    """The backward of ``micro_id``: a bundle of the gradients of the stage's (floating-point) output edges follows;
    the reply is the bundle of its input edges' gradients (none with ``input_grads`` False: the first stage)."""

    run_id: str
    micro_id: str
    graph_hash: str
    input_grads: bool = True
    compression: str = ""  # the codec of the bundles' floating-point gradients both ways ("": none)


@dataclasses.dataclass(frozen=True)
class GraphApply(Message):
    """Two-phase commit of a graph run's step: apply the ``micro_batches`` accumulated since the last step (refused,
    and the step's gradients dropped, if the stage holds another number)."""

    run_id: str
    micro_batches: int
    # parameters this stage shares with another (a tied weight: GPT-2's wte and lm_head): a bundle of their summed
    # gradients, named so, follows; they are the step's gradients of them
    shared: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class GraphGrads(Message):
    """This step's gradients of the run's shared parameters ``names``, one per micro-batch in backward order, as a
    bundle named ``NAME#I``."""

    run_id: str
    names: list[str]


@dataclasses.dataclass(frozen=True)
class GraphFetch(Message):
    """The stage's current parameters and buffers (its ``state_dict``) as a bundle named by key; ``graph_hash`` must
    be this peer's."""

    graph_hash: str


@dataclasses.dataclass(frozen=True)
class LinkProbe(Message):
    """An active link probe (``peers.wire.probe``): without a tensor, one round trip; with one (at most
    ``PROBE_MAX_BYTES``), a timed transfer. The reply carries no tensor, only ``compute_ms``. Peers answer a few per
    caller per minute (``peers.server.probe_calls``)."""

    transfer: bool = False  # True: the message carries the probe's payload


@dataclasses.dataclass(frozen=True)
class InferenceReply(Message):
    """Reply to an open or a step. ``error`` refuses the whole message; ``errors[i]`` refuses part i only
    (its session stays as it was). The tensor holds the outputs of the accepted parts, in order."""

    error: str = ""
    errors: list[str] = dataclasses.field(default_factory=list)  # one per part of a step
    length: int = 0  # tokens the session holds after an open
    handshake: bytes = b""  # the peer's handshake reply to a hello
    step: int = 0  # training: optimizer steps this stage has done
    # the peer's own time on the request, from its tensor read to its reply built (queueing included; 0: not
    # reported), on forwards, steps, training forwards/backwards and probes: callers subtract it from their wall
    # time to measure the network (``swarm.links``; never trusted beyond the wall time)
    compute_ms: float = 0.0
    heartbeat: float = 0.0  # in a hello's reply: the period of the heartbeats the peer will send (0: none)
    alive: bool = False  # a heartbeat: not a reply to any request
    failed_peer: str = ""  # chain: the peer (downstream of this one) whose failure caused ``error``


INFERENCE_KINDS: dict[str, type[Message]] = {
    "hello": InferenceHello, "open": InferenceOpen, "step": InferenceStep, "close": InferenceClose,
    "forward": ForwardRequest, "train_open": TrainOpen, "train_forward": TrainForward, "train_backward": TrainBackward,
    "params_push": ParamsPush, "params_fetch": ParamsFetch, "train_apply": TrainApply, "probe": LinkProbe,
    "push": InferencePush, "relink": InferenceRelink, "replay": InferenceReplay, "train_push": TrainPush,
    "train_fetch": TrainFetch, "adapter_load": AdapterLoad,
    "graph_open": GraphOpen, "graph_forward": GraphForward, "graph_backward": GraphBackward,
    "graph_apply": GraphApply, "graph_fetch": GraphFetch, "graph_grads": GraphGrads,
}
GRAPH_BUNDLE_KINDS = (GraphForward, GraphBackward)  # requests followed by an edge bundle (``peers.wire.edges``)


def pack_inference(message: Message) -> bytes:
    """An inference request's metadata: its fields plus its kind."""
    kind = next(k for k, cls in INFERENCE_KINDS.items() if isinstance(message, cls))
    return msgpack.packb({"kind": kind, **{n: getattr(message, n) for n, _, _ in message._schema()}},
                         use_bin_type=True)


def unpack_inference(data: bytes) -> Message:
    """Parse an inference request; ``ValueError`` if it is malformed or of an unknown kind."""
    raw = unpack_map(data, "inference request")
    kind = raw.get("kind")
    if not isinstance(kind, str) or kind not in INFERENCE_KINDS:  # e.g. {"kind": []}: unhashable (finding 7)
        shown = repr(kind[:64]) if isinstance(kind, str) else f"of type {type(kind).__name__}"
        raise ValueError(f"unknown inference request kind {shown}; expected one of {sorted(INFERENCE_KINDS)}")
    return INFERENCE_KINDS[kind].from_map(raw)


@dataclasses.dataclass(frozen=True)
class StageInfo(Message):
    """What ``rpc_info`` returns: enough for a client to form valid requests."""

    peer_id: str
    model: str
    start: int
    end: int
    hidden_size: int
    dtype: str
    max_batch_size: int
    max_seq_len: int
    max_request_bytes: int
    throughput: float
    version: str
    cache_tokens: int = 0  # inference cache budget: batch rows x tokens, over all sessions
    cache_tokens_free: int = 0
    session_timeout: float = 0.0  # seconds an idle session is kept
    sessions: int = 0  # open inference sessions
    inference_steps: int = 0  # session steps served so far
    inference_batches: int = 0  # batched forwards that ran them (fewer than steps when batching works)
    train_steps: int = 0  # optimizer steps of the training run this peer takes part in
    opens_waiting: int = 0  # session opens waiting for cache space


