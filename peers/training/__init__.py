"""Training: the pieces a trainer (client) and the stage peers use to train a model split across the swarm.

Design: the trainer owns the embedding + head and their AdamW; each stage peer owns its blocks and
their AdamW. A step is ``accumulation`` micro-batches whose losses are divided by ``accumulation``;
each part clips its own grad-norm (per part, not over the whole model) and steps on the lr schedule.

Files:
    config.py    ``OptimConfig`` (AdamW, clipping, schedule; ``to_dict``/``from_dict`` for the wire) and
                 ``TrainConfig`` (one run, ``TrainConfig.from_toml``).
    schedule.py  ``lr_at`` (warmup + constant/linear/cosine), ``make_optimizer`` (AdamW), ``set_lr``.
    part.py      ``PartOptimizer``: one part's grad accumulators, per-part clipping and AdamW step.
    corpus.py    ``builtin_corpus``/``read_corpus``: stdlib docstrings as a locally made training text.
    data.py      ``encode_bytes``, ``encode_with_tokenizer``, ``TokenBatches`` (seeded windows + held-out).
    stage.py     ``StageTrainer`` (a peer's blocks: forward/backward per micro-batch) and ``GradientError``.
    state.py     ``save_stage_state``/``load_stage_state``: weights + AdamW state, written atomically.
    local.py     ``LocalTrainer``: the one-process reference with the same parts; ``loss_of``.
    lora.py      ``parse_adapter`` (LoRA spec text), ``LoraAdapter``: a run's adapters for a stage's blocks.
    lora_files.py  adapters as a ``peft`` folder (``save_peft_folder``, ``read_peft_folder``).
    prompts.py   prompt tuning: the trainer's ``Prompts`` (input and deep), packing deep prompts after hidden states,
                 ``PromptStageTrainer`` (a frozen stage that only returns gradients).
"""

from .config import OptimConfig, TrainConfig
from .corpus import builtin_corpus, read_corpus
from .data import TokenBatches, encode_bytes, encode_with_tokenizer
from .local import LocalTrainer, loss_of
from .part import PartOptimizer, unique_parameters
from .schedule import lr_at, make_optimizer, set_lr
from .stage import GradientError, StageTrainer
from .state import load_stage_state, save_stage_state

__all__ = [
    "OptimConfig", "TrainConfig",
    "builtin_corpus", "read_corpus",
    "TokenBatches", "encode_bytes", "encode_with_tokenizer",
    "LocalTrainer", "loss_of",
    "PartOptimizer", "unique_parameters",
    "lr_at", "make_optimizer", "set_lr",
    "GradientError", "StageTrainer",
    "load_stage_state", "save_stage_state",
]
