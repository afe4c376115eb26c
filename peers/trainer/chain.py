"""One micro-batch through the stages as a chain (issue 12): trainer -> stage 1 -> ... -> stage n -> trainer (loss),
then trainer -> stage n -> ... -> stage 1 -> trainer.

The trainer still sends every stage one request per phase on its own stream (liveness by heartbeats, an error per
hop), but only the first stage's forward carries a tensor (the embeddings) and only the last stage's reply carries
one back (its output); the backward mirrors it (the loss grad to the last stage, the embeddings' grad back from the
first). Everything in between goes stage to stage (``peers.server.training_chain``). So the trainer's link carries
2 hidden states per micro-batch, not 2 per stage.

Each phase's requests go to every stage at once, queued with no await in between (``PeerStream.submit``): every
stage's stream sees the phases of all micro-batches in flight in one global order, which is what makes the chain
deadlock-free and its gradient sums deterministic (stages compute their chained requests in arrival order).

A failure names its peer: a stage whose stream broke, or the one a stage could not push to (or did not hear from
in time): ``ChainError.failed_peer``. It becomes ``StageFailure(peer)``: the trainer bans it and retries the step.
Micro-batch ids carry the attempt, so a push of a given-up attempt can never feed a request of the retry.

Compression (issue 14): the trainer sends the first stage's input and the last stage's grad per the run's setting
(``SwarmTrainer.compression``: per link and direction with "adaptive", from its measured link to that stage and the
stage's reported compute); the grad of a top-k'd output goes back in the same pattern. The step's record holds what
the stages decoded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
from hivemind.p2p import P2PDaemonError, P2PHandlerError

from peers.client.retry import classify
from peers.trainer.step_run import StepRun
from peers.wire.errors import ChainError, MovedError, RequestError
from peers.wire.messages import InferenceReply, Message, TrainBackward, TrainForward
from swarm.compression import Encoded
from swarm.compression.sender import BACKWARD, FORWARD
from swarm.records import PeerRecord

FAILURES = (ConnectionError, TimeoutError, asyncio.TimeoutError, OSError, P2PDaemonError, P2PHandlerError)


class Trainer(Protocol):
    """What this needs of ``peers.trainer.swarm_trainer.SwarmTrainer``."""

    client: Any
    run_id: str
    replicas: list[list[PeerRecord]]
    bytes_sent: int

    def failure(self, peer_id: str, error: BaseException, started: float) -> BaseException: ...


def neighbours(replicas: list[list[PeerRecord]], start: int, end: int) -> tuple[list[str], list[str]]:
    """The peers of the stages before and after span ``start:end`` (all their replicas in the run)."""
    spans = [(group[0].start, group[0].end) for group in replicas]
    if (start, end) not in spans:
        return [], []
    stage = spans.index((start, end))
    before = [r.peer_id for r in replicas[stage - 1]] if stage > 0 else []
    after = [r.peer_id for r in replicas[stage + 1]] if stage + 1 < len(replicas) else []
    return before, after


def forward_messages(run_id: str, micro_id: str, route: list[str], at_steps: list[int] | None = None
                     ) -> list[TrainForward]:
    """Stage k's forward: its input from stage k-1 (or the trainer), its output to stage k+1 (or the trainer);
    ``at_steps``: the weights each uses (staleness 1, ``TrainForward.at_step``)."""
    last, at = len(route) - 1, at_steps or [-1] * len(route)
    return [TrainForward(run_id=run_id, micro_id=micro_id, upstream=route[k - 1] if k else "",
                         downstream=route[k + 1] if k < last else "", at_step=at[k]) for k in range(len(route))]


def backward_messages(run_id: str, micro_id: str, route: list[str], scales: list[float]) -> list[TrainBackward]:
    """Stage k's backward: its output's grad from stage k+1 (or the trainer), its input's grad to stage k-1 (or the
    trainer); ``scales``: each replica's accumulation / share, applied on the stage."""
    last = len(route) - 1
    return [TrainBackward(run_id=run_id, micro_id=micro_id, upstream=route[k + 1] if k < last else "",
                          downstream=route[k - 1] if k else "", scale=scales[k]) for k in range(len(route))]


async def run_phase(trainer: Trainer, route: list[str], messages: list[Message],
                    tensors: list[torch.Tensor | Encoded | None], submitted: Callable[[], None] | None = None
                    ) -> list[tuple[InferenceReply, torch.Tensor | None, torch.Tensor | None]]:
    """Queue ``messages[k]`` to ``route[k]`` for every stage at once, then wait for all the replies (each with the
    top-k indices of its tensor, if any). The first
    failure raises (``StageFailure`` of the peer it names; a refusal as ``RequestError``); the requests left
    pending are answered later (a re-open of the run fails their waits on the stages) and ignored. ``submitted``
    is called right before the requests are queued (with them: no other phase comes in between)."""
    client, timeout = trainer.client, trainer.client.config.request_timeout
    started = time.monotonic()
    streams = []
    for peer_id in route:  # connect first: the submits below must not be separated by awaits
        try:
            streams.append(await client.peer_stream(peer_id))
        except RequestError as e:
            error = classify(e)
            if isinstance(error, MovedError):  # it serves another span now: choose again (no ban)
                raise trainer.failure(peer_id, error, started) from None
            raise error from None
        except FAILURES as e:
            raise trainer.failure(peer_id, e, started) from e
    for tensor in tensors:
        if isinstance(tensor, Encoded):
            trainer.bytes_sent += len(tensor.serialized.buffer)
        elif tensor is not None:
            trainer.bytes_sent += tensor.numel() * tensor.element_size()
    if submitted is not None:
        submitted()
    tasks = [asyncio.ensure_future(stream.submit_coded(message, tensor, timeout, observe=False))
             for stream, message, tensor in zip(streams, messages, tensors, strict=True)]
    pending = set(tasks)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            failed = [t for t in tasks if t in done and t.exception() is not None]
            if failed:
                error, peer_id = failed[0].exception(), route[tasks.index(failed[0])]
                assert error is not None
                if isinstance(error, ChainError) and error.failed_peer:
                    raise trainer.failure(error.failed_peer, error, started) from error
                if isinstance(error, RequestError):
                    if isinstance(classified := classify(error), MovedError):  # choose the stages again, no ban
                        raise trainer.failure(peer_id, classified, started) from None
                    raise classified from None
                if isinstance(error, FAILURES):
                    raise trainer.failure(peer_id, error, started) from error
                raise error
    except BaseException:
        for task in pending:  # replies nobody reads: retrieve their errors so that none is logged as lost
            task.add_done_callback(_ignore)
        raise
    return [task.result() for task in tasks]


def _ignore(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


async def micro_batch(trainer: Any, run: StepRun, input_ids: torch.Tensor, index: int) -> float:
    """Micro-batch ``index`` of step ``run`` through the chain (``SwarmTrainer._micro_batch``'s chain twin); the
    loss."""
    from peers.model.local import default_position_ids
    from peers.training import loss_of

    client, stage_steps, stage_busy = trainer.client, run.stage_steps, run.stage_busy
    micro_id = f"{run.index}.{index}@{run.attempt}"
    input_ids = input_ids.to(client.device)
    embedded = run.embed(client.embedding, input_ids, default_position_ids(input_ids))  # with grad: trains here
    stages = range(len(trainer.replicas))
    replica = [trainer.assignment[k][index] for k in stages]
    route = [trainer.replicas[k][replica[k]].peer_id for k in stages]
    scales = [trainer.accumulation / trainer.shares[k][replica[k]] for k in stages]
    last = len(route) - 1
    sending = trainer.compression  # hidden, grad: what the stages decode (the record's)
    payload, hidden = sending.send(route[0], FORWARD, embedded.detach())
    at_steps = [run.at_step(peer) for peer in route]
    forwards = list(forward_messages(trainer.run_id, micro_id, route, at_steps))
    forwards[last] = dataclasses.replace(forwards[last], reply_codec=sending.reply_codec(route[last], FORWARD, hidden))
    replies = await run_phase(trainer, route, forwards, [payload, *([None] * last)])
    output, pattern = replies[last][1], replies[last][2]
    forward_s = [reply.compute_ms / 1e3 for reply, *_ in replies]
    if output is None:
        raise RequestError(f"the last stage's forward reply carries no output (micro-batch {micro_id})")
    for k, (reply, *_) in enumerate(replies):
        stage_busy[k] += reply.compute_ms / 1e3
    record = run.record
    if record is not None:  # only what the trainer saw; the stages keep the rest (``TrainFetch``) for a replay
        for k in stages:
            record.forward(k, index, route[k], hidden if k == 0 else None, output if k == last else None,
                           micro_id=micro_id, upstream=route[k - 1] if k else "",
                           downstream=route[k + 1] if k < last else "")
    last_hidden = output.to(client.device, client.dtype).requires_grad_(True)
    loss = loss_of(run.head(client.head, last_hidden), input_ids) / trainer.accumulation
    grad, *head_grads = torch.autograd.grad(loss, [last_hidden, *run.params], allow_unused=True)
    await run.before_backward()  # staleness 1: the step before is applied everywhere first

    def submitted() -> None:  # stages compute chained requests in the order they came: the order of the submits
        if record is not None:
            for k in stages:
                record.ran(k, index)

    payload, grad = sending.send(route[last], BACKWARD, grad, indices=pattern)
    backwards = list(backward_messages(trainer.run_id, micro_id, route, scales))
    backwards[0] = dataclasses.replace(backwards[0], reply_codec=sending.reply_codec(route[0], BACKWARD, hidden))
    replies = await run_phase(trainer, route, backwards, [*([None] * last), payload], submitted)
    # each direction of a link carries one tensor per micro-batch while its stage computes the micro-batch's forward
    # and backward: what our next sends to (and the stages' replies from) the end stages hide under
    first_s, last_s = forward_s[0] + replies[0][0].compute_ms / 1e3, forward_s[last] + replies[last][0].compute_ms / 1e3
    for peer, seconds, directions in ((route[0], first_s, (FORWARD, "reply-" + BACKWARD)),
                                      (route[last], last_s, (BACKWARD, "reply-" + FORWARD))):
        for direction in directions:
            sending.note_compute(peer, direction, seconds)
    grad_input = replies[0][1]
    if grad_input is None:
        raise RequestError(f"the first stage's backward reply carries no grad (micro-batch {micro_id})")
    for k, (reply, *_) in enumerate(replies):
        stage_steps[k] = max(stage_steps[k], reply.step)
        stage_busy[k] += reply.compute_ms / 1e3
        if record is not None:
            record.backward(k, index, grad if k == last else None, reply.step, ordered=False)
    embedding_grads = torch.autograd.grad(embedded, run.params, grad_input.to(client.device, client.dtype),
                                          allow_unused=True) if run.params else []
    trainer.part.add(head_grads, embedding_grads)
    return float(loss.detach())
