"""Prompt-tuning runs on a peer (``peers.training.prompts``): many at once, side by side with the peer's training run.

A prompt run trains nothing here (its stage is frozen: ``PromptStageTrainer``), so runs of several trainers can share
the peer's blocks without changing what anyone else computes: each holds only its pending micro-batches. A run is the
trainer's stream's and its id; it ends when that stream closes. At most ``limit`` runs are open at once (each may keep
up to ``max_pending`` micro-batches' activations).
"""

from __future__ import annotations

import logging

from peers.model.blocks import StageBlocks
from peers.training import OptimConfig
from peers.training.prompts import PromptStageTrainer, prompt_run_refusal
from peers.wire.errors import RequestError
from peers.wire.messages import TrainOpen

logger = logging.getLogger(__name__)

MAX_PROMPT_RUNS = 8


class PromptRuns:
    """The prompt runs open on one peer's ``blocks``, by (stream, run id)."""

    def __init__(self, blocks: StageBlocks, *, max_pending: int, limit: int = MAX_PROMPT_RUNS) -> None:
        self.blocks, self.max_pending, self.limit = blocks, max_pending, limit
        self.runs: dict[tuple[object, str], PromptStageTrainer] = {}

    def open(self, request: TrainOpen, stream: object) -> int:
        """Open (or re-open: its partial step is discarded) ``request.run_id`` for ``stream``; returns its step."""
        if not 1 <= request.accumulation <= 1 << 16 or request.run_step < 0:
            raise RequestError("accumulation must be in 1..65536 and run_step >= 0")
        if refusal := prompt_run_refusal(prompts=request.prompts, deep=request.deep_prompts,
                                         staleness=request.staleness, average_every=request.average_every,
                                         chained=bool(request.upstream or request.downstream)):
            raise RequestError(refusal)
        try:
            optim = OptimConfig.from_dict(request.optim)
        except (TypeError, ValueError) as e:
            raise RequestError(f"bad optimizer config: {e}") from None
        key = (stream, request.run_id)
        run = self.runs.get(key)
        if run is None or (run.prompts, run.deep) != (request.prompts, request.deep_prompts):
            if run is None and len(self.runs) >= self.limit:
                raise RequestError(f"this peer serves {self.limit} prompt-tuning runs already: try another peer "
                                   "or later")
            run = PromptStageTrainer(self.blocks, optim, request.accumulation, prompts=request.prompts,
                                     deep=request.deep_prompts, keep_activations=request.keep_activations,
                                     max_pending=self.max_pending, auto_step=not request.explicit_apply)
            self.runs[key] = run
        else:
            run.reset_accumulation()
            run.accumulation, run.auto_step = request.accumulation, not request.explicit_apply
            run.keep_activations = request.keep_activations
        run.part.step_count = max(run.step, request.run_step)  # frozen: the step count simply follows the run's
        logger.info("Prompt run %r: blocks %d:%d with %d prompt(s)%s (step %d; %d prompt run(s) open)",
                    request.run_id, self.blocks.start, self.blocks.end, request.prompts,
                    " and deep prompts" if request.deep_prompts else "", run.step, len(self.runs))
        return run.step

    def get(self, run_id: str, stream: object) -> PromptStageTrainer | None:
        return self.runs.get((stream, run_id))

    def discard(self, run_id: str, stream: object) -> None:
        """Forget ``stream``'s prompt run ``run_id`` if there is one."""
        self.runs.pop((stream, run_id), None)

    def closed(self, stream: object) -> None:
        """The stream's trainer left: its runs end (nothing of theirs is kept)."""
        for key in [k for k in self.runs if k[0] is stream]:
            logger.info("Prompt run %r: its trainer left", key[1])
            del self.runs[key]

    def clear(self) -> None:
        self.runs.clear()
