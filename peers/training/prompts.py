"""Prompt tuning: trainable prompts owned by the trainer, on a served model that stays frozen.

``Prompts`` holds ``count`` input prompt vectors, prepended to the token embeddings, and with ``deep`` one set per
block (``[num_layers, count, hidden]``), added to the hidden states of the first ``count`` positions before each block
(as Petals' deep prompt tuning does). Positions: the prompts take positions ``0 .. count - 1`` and the tokens follow
(``token_positions``), so every block sees one sequence of ``count + T`` positions; the loss is the usual next-token
loss on the token positions only (the head never sees the prompt positions).

Input prompts never leave the trainer (the first stage sees hidden states). Deep prompts travel with each micro-batch
to the stage that owns those blocks, packed after the hidden states' rows (``pack``/``unpack``: the tensor goes
through the same serialization, encryption and size checks), and their gradient comes back packed after the grad of
the stage's input. A stage of a prompt run (``PromptStageTrainer``) trains nothing: its blocks are frozen, every step
leaves them as they were, and it only returns gradients. A peer serves several prompt runs at once, beside its own
training run (``peers.server.prompt_runs``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from peers.core.finite import all_finite
from peers.model.blocks import StageBlocks

from .config import OptimConfig
from .part import PartOptimizer
from .stage import GradientError, StageTrainer, _Saved
from .versions import WeightVersions

MAX_PROMPTS = 4096  # prompt vectors per block a stage takes
EVAL_PREFIX = "eval:"  # a forward whose micro id starts so is a held-out forward: run without grad, nothing kept


class Prompts(nn.Module):
    """The trainer's prompts: ``input [count, hidden]`` and, with ``deep``, ``deep [num_layers, count, hidden]``.

    Input prompts start as seeded normal noise at the scale of the token embeddings (``std``); deep prompts start at
    zero, so a fresh run computes what the base model computes with the input prompts in front."""

    def __init__(self, count: int, hidden_size: int, num_layers: int, *, deep: bool = False, std: float = 0.02,
                 seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if not 1 <= count <= MAX_PROMPTS:
            raise ValueError(f"prompts must be in 1..{MAX_PROMPTS}, got {count}")
        generator = torch.Generator().manual_seed(seed)
        self.count = count
        self.input = nn.Parameter((torch.randn(count, hidden_size, generator=generator) * std).to(dtype))
        self.deep = nn.Parameter(torch.zeros(num_layers, count, hidden_size, dtype=dtype)) if deep else None

    @classmethod
    def for_embedding(cls, embedding: nn.Module, count: int, num_layers: int, *, deep: bool, seed: int) -> Prompts:
        """Prompts at the scale of ``embedding``'s token vectors (its first weight matrix)."""
        weight = next(p for p in embedding.parameters() if p.dim() == 2)
        return cls(count, weight.shape[1], num_layers, deep=deep, std=float(weight.detach().float().std()),
                   seed=seed, dtype=weight.dtype).to(weight.device)

    def prepend(self, embedded: torch.Tensor) -> torch.Tensor:
        """``[B, count + T, H]``: the input prompts, then the token embeddings ``[B, T, H]``."""
        batch = embedded.shape[0]
        return torch.cat([self.input.expand(batch, *self.input.shape).to(embedded.dtype), embedded], dim=1)

    def deep_slice(self, start: int, end: int) -> torch.Tensor | None:
        """The deep prompts of blocks ``[start, end)`` (detached), or None without deep prompts."""
        return None if self.deep is None else self.deep[start:end].detach()


def token_positions(input_ids: torch.Tensor, prompts: int) -> torch.Tensor:
    """Positions ``prompts .. prompts + T - 1`` of the tokens ``[B, T]``, which follow the prompts."""
    t = input_ids.shape[-1]
    return torch.arange(prompts, prompts + t, device=input_ids.device).expand(input_ids.shape[0], t)


def add_prompt(hidden: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
    """``hidden [B, S, H]`` with ``prompt [P, H]`` added to its first ``P`` positions (out of place)."""
    count = prompt.shape[0]
    return torch.cat([hidden[:, :count] + prompt.to(hidden.dtype), hidden[:, count:]], dim=1)


def run_blocks(blocks: StageBlocks, hidden: torch.Tensor, position_ids: torch.Tensor,
               deep: torch.Tensor | None) -> torch.Tensor:
    """The blocks on ``hidden``; with ``deep [len(blocks), P, H]`` each block's prompts are added before it."""
    if deep is None:
        return blocks(hidden, position_ids)[0]
    for block, prompt in zip(blocks, deep, strict=True):
        hidden, _ = block(add_prompt(hidden, prompt), position_ids, None)
    return hidden


def packed_rows(shape: Sequence[int], seq: int) -> int:
    """Rows of ``seq`` positions that deep prompts of ``shape`` take when packed after the hidden states."""
    blocks, count = int(shape[0]), int(shape[1])
    return math.ceil(blocks * count / seq)


def prompt_rows(shape: Sequence[int], seq: int) -> int:
    """Rows that deep prompts of ``shape`` (as a request states it, unchecked) take after the hidden states; 0 for
    a shape that is not ``[blocks, prompts, hidden]`` within bounds (the stage refuses it with a message)."""
    if len(shape) != 3 or seq < 1 or not (0 < shape[0] <= 1 << 12 and 0 < shape[1] <= MAX_PROMPTS):
        return 0
    return packed_rows(shape, seq)


def pack(hidden: torch.Tensor, deep: torch.Tensor) -> torch.Tensor:
    """``[B + r, S, H]``: ``hidden [B, S, H]``, then ``deep [n, P, H]`` flattened into ``r`` rows, zero-padded."""
    _, seq, size = hidden.shape
    rows = packed_rows(deep.shape, seq)
    flat = deep.reshape(-1, size).to(hidden.device, hidden.dtype)
    pad = flat.new_zeros(rows * seq - flat.shape[0], size)
    return torch.cat([hidden, torch.cat([flat, pad]).view(rows, seq, size)])


def unpack(tensor: torch.Tensor, shape: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``pack``'s output back into ``(hidden, deep)``; ``ValueError`` if it cannot hold prompts of ``shape``."""
    rows = packed_rows(shape, tensor.shape[1])
    if tensor.dim() != 3 or tensor.shape[0] <= rows or tensor.shape[2] != shape[2]:
        raise ValueError(f"a tensor {list(tensor.shape)} cannot hold hidden states and deep prompts {list(shape)} "
                         f"packed after them ({rows} row(s) of {tensor.shape[1]} positions)")
    numel = int(shape[0]) * int(shape[1])
    return tensor[:-rows], tensor[-rows:].reshape(-1, tensor.shape[2])[:numel].view(*shape)


def check_prompt_shape(shape: Sequence[int], *, blocks: int, prompts: int, hidden_size: int, seq: int) -> None:
    """Refuse (``ValueError``) deep prompts that do not fit a stage of ``blocks`` blocks in a run of ``prompts``."""
    want = [blocks, prompts, hidden_size]
    if list(shape) != want:
        raise ValueError(f"deep prompts of shape {list(shape)} do not fit this stage: it takes [blocks, prompts, "
                         f"hidden] = {want} (its {blocks} block(s), the run's {prompts} prompts)")
    if prompts >= seq:
        raise ValueError(f"{prompts} prompts leave no token in a sequence of {seq} positions")


class FrozenPart(PartOptimizer):
    """The part of a stage that trains nothing: no parameters, no optimizer; a step only counts."""

    def __init__(self, optim: OptimConfig) -> None:  # no super().__init__: AdamW refuses an empty part
        self.params, self.optim, self.guard = [], optim, False
        self.step_count, self.last_grad_norm = 0, None

    def add(self, *grad_lists: Sequence[torch.Tensor | None]) -> None:
        pass

    def step(self) -> bool:
        self.step_count += 1
        self.last_grad_norm = 0.0
        return True

    def zero_grad(self) -> None:
        pass


class PromptStageTrainer(StageTrainer):
    """A stage of a prompt-tuning run: frozen blocks; each forward may carry the stage's deep prompts (``prompts``
    vectors per block, packed after the hidden states) and each backward returns the input's grad, with the deep
    prompts' grad packed after it. Its weights never change; its step count follows the run's commits."""

    def __init__(self, blocks: StageBlocks, optim: OptimConfig, accumulation: int, *, prompts: int, deep: bool,
                 keep_activations: bool = True, max_pending: int = 64, auto_step: bool = True) -> None:
        flags = [p.requires_grad for p in blocks.parameters()]  # the peer's own run may train these blocks
        super().__init__(blocks, optim, accumulation, keep_activations=keep_activations, max_pending=max_pending,
                         auto_step=auto_step)
        for p, flag in zip(self.blocks.parameters(), flags, strict=True):
            p.requires_grad_(flag)
        self.part = FrozenPart(optim)  # no optimizer: no step of this run changes a weight
        self.versions = WeightVersions([])
        self.prompts, self.deep = prompts, deep
        self._deep: dict[str, torch.Tensor] = {}  # micro id -> its deep prompts (a leaf), until its backward

    def forward_packed(self, micro_id: str, tensor: torch.Tensor, prompt_shape: Sequence[int]) -> torch.Tensor:
        """A forward whose tensor carries hidden states and, in a run with deep prompts, this stage's deep prompts
        of shape ``prompt_shape`` packed after them (``pack``); returns the output hidden states."""
        hidden, deep = self._unpack(micro_id, tensor, prompt_shape)
        positions = torch.arange(hidden.shape[1], device=hidden.device).expand(hidden.shape[0], hidden.shape[1])
        self._check_input(hidden, positions)
        if micro_id.startswith(EVAL_PREFIX):  # held-out loss of the run: nothing kept, nothing pending
            with torch.no_grad():
                return run_blocks(self.blocks, hidden, positions, deep)
        keep = self.keep_activations
        with self._lock:
            self._check_room(micro_id)
            leaf = hidden.detach().requires_grad_(keep)
            deep_leaf = None if deep is None else deep.detach().requires_grad_(keep)
            with torch.set_grad_enabled(keep):
                out = run_blocks(self.blocks, leaf, positions, deep_leaf)
            saved = _Saved(hidden.detach(), positions, version=self._weights_version())
            if keep:
                saved.leaf, saved.output = leaf, out
            self._pending[micro_id] = saved
            if deep_leaf is not None:
                self._deep[micro_id] = deep_leaf
            return out.detach()

    def _unpack(self, micro_id: str, tensor: torch.Tensor, prompt_shape: Sequence[int]
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.deep:
            if prompt_shape:
                raise ValueError(f"micro-batch {micro_id!r} carries deep prompts, but this run has none "
                                 "(deep_prompts = false)")
            return tensor, None
        if not prompt_shape:
            raise ValueError(f"micro-batch {micro_id!r} carries no deep prompts, but this run has them: send each "
                             "stage's deep prompts with its forwards (TrainForward.prompt_shape)")
        check_prompt_shape(prompt_shape, blocks=len(self.blocks), prompts=self.prompts, hidden_size=tensor.shape[-1],
                           seq=tensor.shape[1])
        return unpack(tensor, prompt_shape)

    def forward(self, micro_id: str, hidden: torch.Tensor, position_ids: torch.Tensor, *, at_step: int = -1
                ) -> torch.Tensor:
        """A forward without deep prompts (positions ``0 .. S - 1``, as every stage computes them)."""
        if at_step >= 0:
            raise ValueError("a prompt-tuning run has synchronous steps only (staleness 0)")
        return self.forward_packed(micro_id, hidden, [])

    def backward(self, micro_id: str, grad_output: torch.Tensor, *, hidden: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The grad of the micro-batch's input (with deep prompts: and theirs, packed after it); nothing trains."""
        if hidden is not None:
            raise GradientError("a prompt-tuning stage keeps its micro-batches: a recompute backward is not supported")
        with self._lock:
            saved = self._pending.pop(micro_id, None)
            deep = self._deep.pop(micro_id, None)
            if saved is None:
                raise GradientError(f"micro-batch {micro_id!r} is not pending here (never forwarded, or dropped): "
                                    "forward it again")
            self._check_grad(micro_id, grad_output, saved.hidden)
            if saved.output is not None and saved.leaf is not None and saved.version == self._weights_version():
                leaf, out = saved.leaf, saved.output
            else:  # activations not kept, or the peer's own run stepped the weights since: the forward again
                leaf = saved.hidden.detach().requires_grad_(True)
                deep = None if deep is None else deep.detach().requires_grad_(True)
                with torch.enable_grad():
                    out = run_blocks(self.blocks, leaf, saved.position_ids, deep)
            inputs = [leaf] if deep is None else [leaf, deep]
            grads = torch.autograd.grad(out, inputs, grad_output.to(leaf.device))
            if not all_finite(grads):
                raise GradientError(f"micro-batch {micro_id!r} produced non-finite gradients; it was dropped and "
                                    "nothing was applied")
            self.micro_count += 1
            if self.auto_step and self.micro_count >= self.accumulation:
                self._optimizer_step()
            return grads[0] if deep is None else pack(grads[0], grads[1])

    def _weights_version(self) -> int:
        """Changes whenever a weight of the blocks is changed in place (an optimizer step of the peer's own run)."""
        return sum(p._version for p in self.blocks.parameters())

    def drop(self, micro_id: str) -> bool:
        with self._lock:
            self._deep.pop(micro_id, None)
        return super().drop(micro_id)

    def reset_accumulation(self) -> None:
        with self._lock:
            self._deep.clear()
        super().reset_accumulation()

    def save(self, directory: str | Path) -> Path:
        """Nothing to save: the blocks are the base model's, unchanged (the prompts are the trainer's)."""
        return Path(directory)

    def load(self, directory: str | Path) -> dict[str, Any]:
        """Nothing to load: a prompt run's stage has no state of its own."""
        return {}


def prompt_parameters(prompts: Prompts) -> Iterable[nn.Parameter]:
    """The prompts' parameters, input first (the order of their AdamW and of the gradients the trainer adds)."""
    return [p for p in (prompts.input, prompts.deep) if p is not None]


def prompt_run_refusal(*, prompts: int, deep: bool, staleness: int, average_every: int, chained: bool) -> str:
    """Why a stage refuses to open a run with these prompt settings ('' if it may)."""
    if not 0 <= prompts <= MAX_PROMPTS or (deep and not prompts):
        return f"prompts must be in 0..{MAX_PROMPTS} (0: no prompt tuning), and deep_prompts needs prompts >= 1"
    if not prompts:
        return ""
    if chained:
        return ("prompt tuning runs in the star topology only for now: open the run without upstream/downstream "
                "peers (swarm train --topology star)")
    if staleness or average_every:
        return ("a prompt-tuning run has synchronous steps (staleness 0) and nothing to average (its blocks are "
                "frozen): open it with staleness = 0 and average_every = 0")
    return ""

