"""``benchmarks/slow_links.py`` evaluates a run from what its parts saved: every stage's blocks and the trainer's
embedding + head, put back together in one ``LocalModel`` at their absolute block indices."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from peers.model import LocalModel, make_tiny_model
from peers.model.blocks import StageBlocks
from peers.model.checkpoint import load_blocks, load_client_parts
from peers.model.config import ModelConfig
from peers.trainer.state import trainer_checkpoint_path
from peers.training import loss_of
from peers.training.state import save_stage_state, stage_checkpoint_path

_PATH = Path(__file__).resolve().parents[4] / "benchmarks" / "slow_links.py"
_spec = importlib.util.spec_from_file_location("slow_links", _PATH)
slow_links = importlib.util.module_from_spec(_spec)
sys.modules["slow_links"] = slow_links  # its dataclasses look their module up
_spec.loader.exec_module(slow_links)

SPANS = [(0, 1), (1, 3), (3, 4)]


def _perturb(module: nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))


def test_final_model_puts_each_part_where_it_belongs(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
                                intermediate_size=64)
    gen = torch.Generator().manual_seed(1)
    checkpoints, run = tmp_path / "ckpt", slow_links.run_id("adaptive:1", "0")  # ":" is not kept in file names
    trained = []
    for start, end in SPANS:  # each stage "trained": its own changes, saved as a stage saves them
        blocks = load_blocks(model_dir, start, end)
        _perturb(blocks, gen)
        save_stage_state(stage_checkpoint_path(checkpoints, run, start, end), blocks,
                         torch.optim.AdamW(blocks.parameters()), 3, {"kind": "stage", "start": start, "end": end})
        trained += list(blocks)
    embedding, head = load_client_parts(model_dir)
    part = nn.ModuleDict({"embedding": embedding, "head": head})
    _perturb(part, gen)
    save_stage_state(trainer_checkpoint_path(checkpoints, run), part, torch.optim.AdamW(part.parameters()), 3,
                     {"kind": "trainer"})
    expected = LocalModel(ModelConfig.from_dir(model_dir), embedding, StageBlocks(trained, 0, 4), head).eval()

    got = slow_links.final_model(model_dir, checkpoints, run, SPANS)
    ids = torch.randint(0, 256, (3, 17), generator=gen)
    with torch.no_grad():
        assert torch.equal(got(ids)[0], expected(ids)[0])
        assert slow_links.held_out_loss(got, ids, rows=2) == pytest.approx(loss_of(expected(ids)[0], ids).item(),
                                                                           rel=1e-6)
        assert not torch.equal(got(ids)[0], LocalModel.from_dir(model_dir)(ids)[0])  # trained, not initial
    assert slow_links.stage_steps(checkpoints, run, SPANS) == [3, 3, 3]


def test_configs_parse_and_refuse_what_does_not_exist():
    assert slow_links.parse_configs("none/0, adaptive/1, none/1all") == [("none", "0"), ("adaptive", "1"),
                                                                         ("none", "1all")]
    for bad in ("topk/0", "none/2", "none/0all", "none", "none/0,none/0", ""):
        with pytest.raises(ValueError, match="--configs"):
            slow_links.parse_configs(bad)


def test_summary_compares_with_none_and_staleness_0():
    runs = {"none/0": {"tokens_per_s": 100.0, "held_out_loss": 3.0},
            "adaptive/0": {"tokens_per_s": 350.0, "held_out_loss": 3.03},
            "adaptive/1": {"tokens_per_s": 420.0, "held_out_loss": 3.2},
            "int8/0": {"skipped": "compression='int8' is not available"}}
    out = slow_links.summarise(runs)
    assert out["vs_none"]["adaptive/0"] == {"speedup": 3.5, "held_out_loss_rel": 0.01}
    assert out["staleness_1_vs_0"]["adaptive"]["speedup"] == 1.2
    assert out["not_run"] == {"int8/0": "compression='int8' is not available"}
    targets = list(out["targets"].values())
    # no strict AdaTopK run and no none/1 here (None); staleness with AdaTopK: faster, but loss 5.6% above
    assert targets == [True, None, None, False]
