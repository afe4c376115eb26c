"""Training as a chain (issue 12) on one peer: micro-batches come from the previous stage and go to the next one
without passing through the trainer.

A chained ``TrainForward`` / ``TrainBackward`` names its route neighbours (``upstream``: who sends its input, or its
output's grad; ``downstream``: who gets its output, or its input's grad; "" = the trainer). With a peer upstream
the request carries no tensor: it waits (deferred, ``peers.server.calls.defer``) for that peer's ``TrainPush``, which
lands in an ``Inbox`` keyed by (micro-batch, direction, pusher). With a peer downstream the stage pushes its result
there over its own encrypted stream to that peer (``PeerLinks``, as averaging does) and replies without a tensor;
a push that fails replies an error naming that peer (``failed_peer``), so the trainer bans the right one.

Pushes are taken only from the peers the trainer's ``TrainOpen`` named as the run's adjacent stages (``upstream``
for forwards, ``downstream`` for backwards), and a request only takes a push from its own route neighbour.

Order: a stage computes its chained forwards in the order they came on the trainer's stream, and its chained
backwards in theirs (each waits for the one of its direction before it, ``_Turns``), whatever order their pushes
arrive in; a forward does not wait for a backward nor the other way round. The trainer sends each phase to every
stage at once, so all stages see each direction's phases in one global order: the earliest unfinished forward (and
backward) is first in line everywhere and can always go on (no deadlock: a backward's grad exists only once its
forward ran here), and gradients are summed in the order the trainer sent the backwards (the same on every run:
losses and weights equal one process, and a replay knows the order). Forwards change no gradient and name the
weights they use (``at_step``), so letting them pass backwards changes no result; it keeps both directions of a
slow link busy: with one order for both, a forward waited for the grad of an earlier micro-batch to cross the link
the other way, and the link carried one direction at a time.

Re-opening the run, or its trainer's stream closing, fails every pending wait at once (``reset``).

Replay (``peers.trainer.replay``) needs each stage's inputs, outputs and output grads of a step; in a chain the
trainer sees only the first stage's input and the last stage's output and grad. So a stage keeps, for the last step
it applied, what it exchanged with other peers (the inputs it was pushed, the outputs and input grads it pushed),
and hands them to the trainer on request (``TrainFetch``): a stage that missed a commit is replayed from what its
neighbours kept. Memory: up to three hidden states per micro-batch of the stage's share of one step.

Compression (issue 14, ``swarm.compression.sender``): the run's setting (``TrainOpen.compression``) says how this
stage sends its forward outputs, its input grads and its replies to the trainer; "adaptive" chooses per link and
direction from our measured link to the receiver and our compute time on the micro-batch. An input that came top-k'd
(from the trainer or pushed) has its indices kept with the micro-batch, and its grad goes back in the same pattern.
What a stage keeps for replays is what its neighbours decoded, so a replay computes on what the step computed on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from typing import Protocol

import torch

from peers.server.averaging import StreamFor
from peers.server.inbox import Inbox
from peers.wire.errors import ChainError, RequestError
from peers.wire.messages import TrainBackward, TrainForward, TrainOpen, TrainPush
from privacy.peer_ids import short_id
from swarm.compression import Codec, Encoded
from swarm.compression.sender import BACKWARD, FORWARD, RunCompression
from swarm.links import LinkTable, RobustEma

MAX_NEIGHBOURS = 64  # peer ids per list of a TrainOpen
MAX_SCALE = float(1 << 16)  # accumulation / share is at most the accumulation
DIAL_TIMEOUT = 5.0  # seconds to reach the next peer for a push (a dead one must not hold up the stream's replies)
KEPT = ("input", "output", "grad")
MAX_PATTERNS = 4096  # top-k index sets of inputs kept at most (micro-batches in flight)


class Stage(Protocol):
    """What this needs of ``peers.server.training_rpc.TrainingRPC``: its forward and backward of one micro-batch."""

    async def forward(self, request: TrainForward, hidden: torch.Tensor, stream: object) -> torch.Tensor: ...

    async def backward(self, request: TrainBackward, tensor: torch.Tensor, stream: object) -> torch.Tensor: ...


class _Turns:
    """Chained requests compute one after the other, in the order they arrived."""

    def __init__(self) -> None:
        self._last: asyncio.Future | None = None

    def take(self) -> tuple[asyncio.Future | None, asyncio.Future]:
        previous, mine = self._last, asyncio.get_running_loop().create_future()
        self._last = mine
        return previous, mine

    @staticmethod
    async def wait(previous: asyncio.Future | None) -> None:
        if previous is not None and not previous.done():
            await asyncio.shield(previous)

    @staticmethod
    def release(previous: asyncio.Future | None, mine: asyncio.Future) -> None:
        """Our turn is over; if we left before ours came (cancelled), it ends when the one before ends."""
        def done(_: object = None) -> None:
            if not mine.done():
                mine.set_result(None)

        if previous is None or previous.done():
            done()
        else:
            previous.add_done_callback(done)


class TrainChain:
    """The chain side of this peer's run: its neighbours, the inbox of pushes, ordered compute, pushes out."""

    def __init__(self, rpc: Stage, stream_for: StreamFor | None, *, timeout: float,
                 links: LinkTable | None = None) -> None:
        self.rpc, self.stream_for, self.timeout, self.links = rpc, stream_for, timeout, links
        self.compression = RunCompression(links=links)  # how we send the run's tensors
        # backward? -> this stage's compute of that phase, smoothed: one micro-batch's time jitters by 2-3x on a
        # shared machine, more than the codec chooser's hysteresis, and the codec flapped message by message
        self._phase_s: dict[bool, RobustEma] = {}
        self._patterns: dict[str, torch.Tensor] = {}  # micro_id -> flat indices of its top-k'd input
        self.inbox = Inbox()
        self.upstream: frozenset[str] = frozenset()  # previous stage's replicas: push us inputs
        self.downstream: frozenset[str] = frozenset()  # next stage's replicas: push us grads
        self.generation = 0  # bumped on every re-open and when the owner leaves: older requests stop
        self._turns = {False: _Turns(), True: _Turns()}  # backward? -> the order of that direction's requests
        self._given_up: asyncio.Future | None = None  # done at the next reset: pushes under way stop
        self._step: dict[str, dict[str, torch.Tensor]] = {}  # micro_id -> KEPT -> tensor, this step
        self._applied: dict[str, dict[str, torch.Tensor]] = {}  # the same for the last step applied

    # ---- run lifecycle ------------------------------------------------------------------------------
    def check_open(self, request: TrainOpen) -> None:
        for name, peers in (("upstream", request.upstream), ("downstream", request.downstream)):
            if len(peers) > MAX_NEIGHBOURS or any(not 1 <= len(p) <= 128 for p in peers):
                raise RequestError(f"{name} must list at most {MAX_NEIGHBOURS} peer ids")
        try:
            RunCompression(request.compression)
        except ValueError as e:
            raise RequestError(str(e)) from None
        if (request.upstream or request.downstream) and self.stream_for is None:
            raise RequestError("this peer cannot reach other peers: it cannot train in a chain")

    def opened(self, request: TrainOpen) -> None:
        self.upstream, self.downstream = frozenset(request.upstream), frozenset(request.downstream)
        if request.compression != self.compression.setting:
            self.compression = RunCompression(request.compression, self.links)
        self.reset(f"run {request.run_id!r} was re-opened: this request belongs to an attempt that was given up")

    def reset(self, why: str) -> None:
        """Fail every wait of the run now and forget the partial step's kept tensors (not the last applied's)."""
        self.generation += 1
        self.inbox.fail(lambda key: True, why)
        self._step = {}
        self._patterns.clear()
        if self._given_up is not None and not self._given_up.done():
            self._given_up.set_result(why)
        self._given_up = None

    def applied(self, pending: Collection[str] = ()) -> None:
        """The step was applied: what it exchanged is kept for a replay of a stage that missed its commit. The
        ``pending`` micro-batches (staleness 1: the next step's, forwarded already) stay with the step under way."""
        self._applied = {m: kept for m, kept in self._step.items() if m not in pending}
        self._step = {m: kept for m, kept in self._step.items() if m in pending}

    def kept(self, micro_id: str, what: str) -> torch.Tensor:
        if what not in KEPT:
            raise RequestError(f"what must be one of {list(KEPT)}, got {what[:32]!r}")
        tensor = self._applied.get(micro_id, {}).get(what)
        if tensor is None:
            raise RequestError(f"this stage kept no {what} of micro-batch {micro_id[:64]!r} in the last step it "
                               "applied")
        return tensor

    # ---- pushes in ----------------------------------------------------------------------------------
    def receive(self, request: TrainPush, tensor: torch.Tensor, sender: str, indices: torch.Tensor | None = None
                ) -> None:
        """A neighbour's output (or grad, ``backward``) for one micro-batch; only from the peers the trainer named.
        ``indices``: the flat indices a top-k push kept (a forward's are kept: its grad goes back in that pattern)."""
        allowed = self.downstream if request.backward else self.upstream
        if sender not in allowed:
            which = "next" if request.backward else "previous"
            raise RequestError(f"push refused: peer {short_id(sender)} is not a {which} stage of run "
                               f"{request.run_id!r} (its trainer names who may push to this peer)")
        if not tensor.is_floating_point():
            raise RequestError(f"a pushed tensor must be floating point, got {tensor.dtype}")
        self.inbox.put((request.micro_id, request.backward, sender), tensor)
        if not request.backward:
            self._pattern(request.micro_id, indices)

    # ---- chained requests -----------------------------------------------------------------------------
    def check_route(self, request: TrainForward | TrainBackward) -> None:
        """Refuse at once a route naming peers the run's open did not name (``upstream`` of a backward is the next
        stage, a peer of our ``downstream`` list)."""
        backward = isinstance(request, TrainBackward)
        sources, targets = (self.downstream, self.upstream) if backward else (self.upstream, self.downstream)
        for role, peer, allowed in (("upstream", request.upstream, sources), ("downstream", request.downstream,
                                                                            targets)):
            if peer and peer not in allowed:
                raise RequestError(f"{role} peer {short_id(peer)} was not named by this run's train_open")
        if request.reply_codec:
            if request.downstream:
                raise RequestError("reply_codec is for an output returned to the trainer; this one goes to a peer")
            try:
                Codec.parse(request.reply_codec)
            except ValueError as e:
                raise RequestError(f"reply_codec: {e}") from None
        if backward:
            if request.recompute:
                raise RequestError("a chained backward recomputes from the input this stage kept: send it with "
                                   "recompute=False (open the run with keep_activations=False)")
            if not 0 < request.scale <= MAX_SCALE:  # NaN fails too
                raise RequestError(f"scale must be in (0, {MAX_SCALE:.0f}], got {request.scale}")

    async def run(self, request: TrainForward | TrainBackward, tensor: torch.Tensor | None, stream: object,
                  indices: torch.Tensor | None = None, trainer: str = ""
                  ) -> tuple[torch.Tensor | Encoded | None, float]:
        """Compute one chained request: its input from the trainer (``tensor``; ``indices`` if it came top-k'd) or
        pushed by its upstream, its result pushed downstream (then None) or returned to peer ``trainer`` as it
        travels (the run's compression); with this peer's compute time in ms."""
        backward, generation = isinstance(request, TrainBackward), self.generation
        if tensor is not None and not backward:
            self._pattern(request.micro_id, indices)
        turns = self._turns[backward]
        previous, mine = turns.take()
        try:
            if tensor is None:
                what = f"the {'grad' if backward else 'input'} of micro-batch {request.micro_id[:64]!r} from peer " \
                       f"{short_id(request.upstream)}"
                try:
                    tensor = await self.inbox.take((request.micro_id, backward, request.upstream), self.timeout, what)
                except RequestError as e:
                    if generation != self.generation:  # re-opened: the attempt was given up
                        raise
                    raise ChainError(str(e), request.upstream) from None  # the upstream died or hangs
            await turns.wait(previous)
            self._check_generation(generation)
            started = time.perf_counter()
            if isinstance(request, TrainBackward):  # (``backward`` applies the request's scale)
                output = await self.rpc.backward(request, tensor, stream)
            else:
                output = await self.rpc.forward(request, tensor, stream)
            compute_ms = max(1e-3, 1e3 * (time.perf_counter() - started))
        finally:
            turns.release(previous, mine)
        self._check_generation(generation)
        receiver = request.downstream or trainer
        pattern = self._patterns.pop(request.micro_id, None) if backward else None
        chosen = Codec.parse(request.reply_codec) if request.reply_codec and not request.downstream else None
        # each direction of a link carries one tensor per micro-batch, while the stage computes that micro-batch's
        # forward and backward: the transfer hides under both (each smoothed over the recent micro-batches)
        self._phase_s.setdefault(backward, RobustEma()).add(compute_ms / 1e3)
        payload, arrived = self.compression.send(receiver, BACKWARD if backward else FORWARD, output,
                                                 compute_s=sum(e.value or 0.0 for e in self._phase_s.values()),
                                                 indices=pattern, codec=chosen)
        self._keep(request, tensor, arrived, backward)
        if not request.downstream:
            return payload, compute_ms
        await self._push(request.downstream, TrainPush(run_id=request.run_id, micro_id=request.micro_id,
                                                       backward=backward), payload)
        return None, compute_ms

    def _pattern(self, micro_id: str, indices: torch.Tensor | None) -> None:
        """Keep (or, None, forget) the top-k pattern of a micro-batch's input until its backward."""
        self._patterns.pop(micro_id, None)
        if indices is None:
            return
        if len(self._patterns) >= MAX_PATTERNS:
            del self._patterns[next(iter(self._patterns))]
        self._patterns[micro_id] = indices

    def _check_generation(self, generation: int) -> None:
        if generation != self.generation:
            raise RequestError("the run was re-opened (or its trainer left) while this request waited: it belongs "
                               "to an attempt that was given up")

    def _keep(self, request: TrainForward | TrainBackward, tensor: torch.Tensor, output: torch.Tensor,
              backward: bool) -> None:
        kept = self._step.setdefault(request.micro_id, {})
        if backward:
            if request.downstream:
                kept["grad"] = output.detach()
            return
        if request.upstream:
            kept["input"] = tensor.detach()
        if request.downstream:
            kept["output"] = output.detach()

    async def _push(self, peer: str, message: TrainPush, tensor: torch.Tensor | Encoded) -> None:
        """Hand our result to the next peer of the route; any failure is that peer's (``ChainError``). A re-open
        of the run (the trainer retries) stops it at once: the replies after it on the trainer's stream (the
        re-open's among them) must not wait for a dial to a dead peer."""
        what = "grad" if message.backward else "output"

        async def send() -> None:
            assert self.stream_for is not None  # check_open
            stream = await asyncio.wait_for(self.stream_for(peer), DIAL_TIMEOUT)
            await stream.call(message, tensor, self.timeout)

        if self._given_up is None:
            self._given_up = asyncio.get_running_loop().create_future()
        given_up, sending = self._given_up, asyncio.ensure_future(send())
        try:
            await asyncio.wait({sending, given_up}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not sending.done():
                sending.cancel()
        if not sending.done() or sending.cancelled():
            why = given_up.result() if given_up.done() else "it was cancelled"
            raise RequestError(f"push of micro-batch {message.micro_id[:64]!r} stopped: {why}")
        if (error := sending.exception()) is not None:
            raise ChainError(f"could not push the {what} of micro-batch {message.micro_id[:64]!r} to peer "
                             f"{short_id(peer)}: {error!r}", peer) from None
