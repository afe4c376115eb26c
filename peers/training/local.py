"""``LocalTrainer``: the whole model trained in one process with plain autograd; the numerical reference.

It splits the parameters into the same parts as the swarm (the trainer's embedding + head, and one part per stage
range) and gives each part its own AdamW and its own grad-norm clipping, so a swarm run with the same stage ranges
must reproduce its parameters and losses. With ``staleness=1`` the first ``stale_micro_batches`` micro-batches of each
step take their gradients at the weights from before the previous step (all of them: w[n+1] = w[n] - lr * g(w[n-1]);
the first step at w[0]) and the others at the current ones, as a swarm run with asynchronous steps computes them: the
old weights are copied in for the stale micro-batches, and the current ones back for the others and the optimizer
step. With ``adapter`` (a LoRA spec, ``peers.training.lora``) only each stage's adapter trains, made from ``seed`` as
a stage peer makes it; the embedding, head and blocks stay frozen. With ``prompts`` (prompt tuning,
``peers.training.prompts``) the model is frozen and the only part is the prompts, as on a swarm run with prompts. A
run has adapters or prompts, not both.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from peers.model.adapters import using
from peers.model.checkpoint import load_blocks, load_client_parts
from peers.model.config import ModelConfig
from peers.model.local import default_position_ids

from .config import OptimConfig
from .lora import LoraAdapter, parse_adapter
from .part import PartOptimizer, unique_parameters
from .prompts import Prompts, prompt_parameters, run_blocks, token_positions
from .versions import check_stale_micro_batches

logger = logging.getLogger(__name__)


def loss_of(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: ``logits[:, :-1]`` predict ``input_ids[:, 1:]``."""
    if logits.shape[:2] != input_ids.shape or input_ids.shape[1] < 2:
        raise ValueError(f"logits {tuple(logits.shape)} do not fit input_ids {tuple(input_ids.shape)} "
                         "(need [batch, seq >= 2, vocab] and [batch, seq])")
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), input_ids[:, 1:].reshape(-1))


def check_stage_ranges(stages: Sequence[tuple[int, int]], num_layers: int) -> list[tuple[int, int]]:
    """Validate that ``stages`` cover blocks ``0 .. num_layers`` contiguously, in order."""
    ranges = [(int(a), int(b)) for a, b in stages]
    at = 0
    for a, b in ranges:
        if a != at or b <= a:
            raise ValueError(f"stages {ranges} must be non-empty ranges covering blocks 0..{num_layers} in order, "
                             "e.g. [(0, 2), (2, 4)]")
        at = b
    if at != num_layers:
        raise ValueError(f"stages {ranges} end at block {at}, but the model has {num_layers} blocks")
    return ranges


class LocalTrainer:
    """Embedding, per-stage blocks and head in one process; one AdamW + clipping per part."""

    def __init__(self, model_dir: str | Path, optim: OptimConfig, accumulation: int, *,
                 stages: Sequence[tuple[int, int]] | None = None, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = torch.float32, staleness: int = 0, stale_micro_batches: int | None = 1,
                 adapter: str = "", prompts: int = 0, deep_prompts: bool = False, seed: int = 0) -> None:
        if accumulation < 1:
            raise ValueError(f"accumulation must be >= 1, got {accumulation}")
        if staleness not in (0, 1):
            raise ValueError(f"staleness must be 0 or 1, got {staleness}")
        check_stale_micro_batches(stale_micro_batches)
        self.staleness = staleness
        self.stale_micro_batches = stale_micro_batches  # staleness 1: how many of a step's run on the old weights
        self._before: list[torch.Tensor] | None = None  # staleness 1: every weight before the last step
        self.config = ModelConfig.from_dir(model_dir)
        self.accumulation = accumulation
        ranges = check_stage_ranges(stages or [(0, self.config.num_layers)], self.config.num_layers)
        self.embedding, self.head = load_client_parts(model_dir, device=device, dtype=dtype)
        spec = parse_adapter(adapter)
        if spec is not None and prompts:
            raise ValueError("a run trains LoRA adapters or prompts, not both: drop `adapter` or `prompts`")
        self.blocks = [load_blocks(model_dir, a, b, device=device, dtype=dtype) for a, b in ranges]
        self.prompts: Prompts | None = None
        self.adapters: list[LoraAdapter] = []
        if prompts or spec is not None:  # the served model stays frozen
            for module in (self.embedding, self.head, *self.blocks):
                module.requires_grad_(False)
        if prompts:  # prompt tuning: the model stays frozen, only the prompts train (one part, as on the trainer)
            if staleness:
                raise ValueError("prompt tuning has synchronous steps only (staleness 0)")
            self.prompts = Prompts.for_embedding(self.embedding, prompts, self.config.num_layers, deep=deep_prompts,
                                                 seed=seed)
            self.client = PartOptimizer(prompt_parameters(self.prompts), optim)
            self.stage_parts = []
            return
        if spec is not None:  # a LoRA run trains each stage's adapter only; the base model stays frozen (as loaded)
            self.adapters = [LoraAdapter(b, spec, seed) for b in self.blocks]
            self.client = PartOptimizer([], optim)
            self.stage_parts = [PartOptimizer(a.params(), optim) for a in self.adapters]
            return
        for module in (self.embedding, self.head, *self.blocks):
            module.requires_grad_(True).train()
        self.client = PartOptimizer(unique_parameters(self.embedding, self.head), optim)
        self.stage_parts = [PartOptimizer(b.parameters(), optim) for b in self.blocks]

    @property
    def step(self) -> int:
        """Optimizer steps done."""
        return self.client.step_count

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` for ``input_ids [B, T]`` (with grad when grad mode is on)."""
        if self.prompts is not None:
            return self._prompted_logits(input_ids, self.prompts)
        positions = default_position_ids(input_ids)
        hidden = self.embedding.embed(input_ids, positions)
        for k, blocks in enumerate(self.blocks):
            with using(self.adapters[k].deltas() if self.adapters else None):
                hidden, _ = blocks(hidden, positions)
        return self.head.head(hidden)

    def _prompted_logits(self, input_ids: torch.Tensor, prompts: Prompts) -> torch.Tensor:
        """The prompts, then the tokens, through the blocks (deep prompts added before each); the tokens' logits."""
        hidden = prompts.prepend(self.embedding.embed(input_ids, token_positions(input_ids, prompts.count)))
        positions = default_position_ids(hidden[..., 0])
        for blocks in self.blocks:
            deep = None if prompts.deep is None else prompts.deep[blocks.start:blocks.end]
            hidden = run_blocks(blocks, hidden, positions, deep)
        return self.head.head(hidden[:, prompts.count:])

    def train_step(self, micro_batches: Sequence[torch.Tensor]) -> float:
        """One optimizer step over ``accumulation`` micro-batches ``[b, T + 1]``; returns their mean loss."""
        if len(micro_batches) != self.accumulation:
            raise ValueError(f"train_step needs {self.accumulation} micro-batches (accumulation), "
                             f"got {len(micro_batches)}")
        parts = (self.client, *self.stage_parts)
        params = [p for part in parts for p in part.params]
        now = [p.detach().clone() for p in params] if self._before is not None else None
        if self._before is not None:
            _copy(params, self._before)  # staleness 1: the gradients are taken at the weights before the last step
        total = 0.0
        for i, input_ids in enumerate(micro_batches):
            if now is not None and i == self.stale_micro_batches:
                _copy(params, now)  # the rest of the step: the current weights
            loss = loss_of(self.logits(input_ids), input_ids) / self.accumulation
            loss.backward()
            total += loss.item()
        if now is not None:
            _copy(params, now)
        if self.staleness:
            self._before = [p.detach().clone() for p in params]
        for part in parts:
            part.step()
        return total

    @torch.no_grad()
    def evaluate(self, input_ids: torch.Tensor) -> float:
        """Mean next-token loss on ``input_ids [B, T]`` without touching gradients."""
        return loss_of(self.logits(input_ids), input_ids).item()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter (detached): ``embedding.*``, ``head.*`` and ``blocks.<absolute layer>.*``."""
        out = {f"embedding.{k}": p.detach() for k, p in self.embedding.named_parameters()}
        out.update({f"head.{k}": p.detach() for k, p in self.head.named_parameters()})
        for blocks in self.blocks:
            for k, p in blocks.named_parameters():
                index, rest = k.split(".", 1)
                out[f"blocks.{blocks.start + int(index)}.{rest}"] = p.detach()
        return out


def _copy(params: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, value in zip(params, values, strict=True):
            p.copy_(value)
