"""Prompt tuning on the trainer (``peers.training.prompts``): its prompts, its micro-batches and its held-out logits.

The trainer owns the prompts and their AdamW (its part is the prompts; the embedding and head stay frozen, like the
blocks on the stages). A micro-batch (star topology): the token embeddings at positions ``P ..``, the input prompts in
front, through each stage with that stage's deep prompts packed after the hidden states (``TrainForward.prompt_shape``),
the loss on the token positions, then the backwards in reverse: each reply carries the grad of the stage's input and of
its deep prompts; the input prompts' grad is taken here. Held-out logits go the same way with ``EVAL_PREFIX`` ids,
which a prompt stage runs without keeping anything.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from peers.trainer.step_run import StepRun
from peers.training import OptimConfig, PartOptimizer, loss_of
from peers.training.prompts import EVAL_PREFIX, Prompts, pack, prompt_parameters, token_positions, unpack
from peers.wire.messages import Message, TrainBackward, TrainForward
from swarm.records import PeerRecord


class SwarmTrainer(Protocol):
    """What this needs of ``peers.trainer.swarm_trainer.SwarmTrainer`` (which imports this module)."""

    client: Any
    run_id: str
    optim: OptimConfig
    part: PartOptimizer
    prompts: Prompts | None
    topology: str
    staleness: int
    recompute: bool
    average_every: int
    accumulation: int
    replicas: list[list[PeerRecord]]
    assignment: list[list[int]]
    bytes_sent: int
    _evals: int

    async def _call(self, peer_id: str, message: Message, tensor: torch.Tensor | None) -> Any: ...


def setup_prompts(trainer: SwarmTrainer, count: int, deep: bool, seed: int) -> Prompts | None:
    """With ``count`` prompts: freeze the embedding and head, make the prompts (seeded) and make them the trainer's
    part; refuse what prompt tuning does not support yet. None without prompts."""
    if not count:
        if deep:
            raise ValueError("deep_prompts needs prompts >= 1")
        return None
    if trainer.topology != "star":
        raise ValueError("prompt tuning runs in the star topology only for now: pass topology='star' "
                         "(swarm train --topology star)")
    if trainer.staleness or trainer.recompute or trainer.average_every:
        raise ValueError("prompt tuning needs staleness = 0, recompute = false (keep_activations = true) and "
                         "average_every = 0 (the stages' blocks are frozen: nothing to average)")
    client = trainer.client
    for module in (client.embedding, client.head):
        module.requires_grad_(False)
    prompts = Prompts.for_embedding(client.embedding, count, client.model_config.num_layers, deep=deep, seed=seed)
    trainer.part = PartOptimizer(prompt_parameters(prompts), trainer.optim)
    return prompts


def _first_hidden(trainer: SwarmTrainer, prompts: Prompts, input_ids: torch.Tensor) -> torch.Tensor:
    client = trainer.client
    with torch.no_grad():
        embedded = client.embedding.embed(input_ids, token_positions(input_ids, prompts.count))
    return prompts.prepend(embedded)


async def _forward(trainer: SwarmTrainer, peer_id: str, micro_id: str, hidden: torch.Tensor, prompts: Prompts,
                   span: tuple[int, int]) -> tuple[float, torch.Tensor]:
    deep = prompts.deep_slice(*span)
    payload = hidden if deep is None else pack(hidden, deep)
    trainer.bytes_sent += payload.numel() * payload.element_size()
    message = TrainForward(run_id=trainer.run_id, micro_id=micro_id,
                           prompt_shape=[] if deep is None else list(deep.shape))
    reply, output = await trainer._call(peer_id, message, payload)
    return reply.compute_ms, output


async def prompt_micro_batch(trainer: SwarmTrainer, run: StepRun, input_ids: torch.Tensor, index: int) -> float:
    """Micro-batch ``index`` of the step through a replica of each stage (star); adds the prompts' grads. Grads go
    unscaled to every replica: a frozen stage has no step of its own to weigh."""
    prompts, client = trainer.prompts, trainer.client
    assert prompts is not None
    micro_id = f"{run.index}.{index}"
    input_ids = input_ids.to(client.device)
    first = _first_hidden(trainer, prompts, input_ids)  # with grad: the input prompts train here
    hidden, route = first.detach(), []  # route: the replica of each stage that takes this micro-batch
    for stage, group in enumerate(trainer.replicas):
        route.append(group[trainer.assignment[stage][index]].peer_id)
        compute_ms, hidden = await _forward(trainer, route[-1], micro_id, hidden, prompts,
                                            (group[0].start, group[0].end))
        run.stage_busy[stage] += compute_ms / 1e3
    last = hidden.to(client.device, client.dtype).requires_grad_(True)
    loss = loss_of(client.head.head(last[:, prompts.count:]), input_ids) / trainer.accumulation
    (grad,) = torch.autograd.grad(loss, [last])
    deep_grads: list[torch.Tensor] = []
    for stage in reversed(range(len(trainer.replicas))):
        trainer.bytes_sent += grad.numel() * grad.element_size()
        reply, returned = await trainer._call(route[stage], TrainBackward(run_id=trainer.run_id, micro_id=micro_id),
                                              grad)
        if prompts.deep is not None:
            span = trainer.replicas[stage][0]
            grad, deep_grad = unpack(returned, [span.end - span.start, prompts.count, prompts.deep.shape[-1]])
            deep_grads.insert(0, deep_grad)
        else:
            grad = returned
        run.stage_steps[stage] = max(run.stage_steps[stage], reply.step)
        run.stage_busy[stage] += reply.compute_ms / 1e3
    (input_grad,) = torch.autograd.grad(first, [prompts.input], grad.to(client.device, client.dtype))
    grads = [input_grad] if prompts.deep is None else \
        [input_grad, torch.cat(deep_grads).to(prompts.deep.device, prompts.deep.dtype)]
    trainer.part.add(grads)
    return float(loss.detach())


async def prompted_logits(trainer: SwarmTrainer, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of the tokens ``input_ids`` with the trainer's prompts, through its stages (nothing kept there)."""
    prompts, client = trainer.prompts, trainer.client
    assert prompts is not None
    if not trainer.replicas:
        raise RuntimeError("the prompt run is not open on any stage yet: call start() first")
    with torch.no_grad():
        hidden = _first_hidden(trainer, prompts, input_ids.to(client.device)).detach()
        trainer._evals += 1
        micro_id = f"{EVAL_PREFIX}{trainer._evals}"
        for group in trainer.replicas:
            _, hidden = await _forward(trainer, group[0].peer_id, micro_id, hidden, prompts,
                                       (group[0].start, group[0].end))
        return client.head.head(hidden.to(client.device, client.dtype)[:, prompts.count:])
