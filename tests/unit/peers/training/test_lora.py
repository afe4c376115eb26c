"""LoRA adapters: the spec text, the layer math (peft's order), per-call activation that leaves the shared blocks and
other threads alone, deterministic init whatever the split, and a stage that trains only its adapter."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from peers.model import load_blocks, make_tiny_model
from peers.model.adapters import using
from peers.model.local import default_position_ids
from peers.training import OptimConfig, StageTrainer
from peers.training.lora import LoraAdapter, LoraSpec, parse_adapter

OPTIM = OptimConfig(lr=1e-2, warmup_steps=0, schedule="constant", clip_norm=1.0, weight_decay=0.0)
SPEC = "lora:r=4,alpha=8,targets=q_proj+v_proj+down_proj"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("lora") / "tiny", hidden_size=32, num_layers=4, num_heads=4,
                           num_kv_heads=2, intermediate_size=64, seed=3)


def _input(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(seed))
    return hidden, default_position_ids(hidden[..., 0])


def test_spec_parsing() -> None:
    assert parse_adapter("") is None
    spec = parse_adapter(" lora:r=8,alpha=16,targets=q_proj+v_proj ")
    assert spec == LoraSpec(8, 16.0, ("q_proj", "v_proj")) and spec.scaling == 2.0
    assert parse_adapter(spec.text()) == spec
    assert parse_adapter("lora:r=4,targets=c_attn").alpha == 4.0  # alpha defaults to r
    for bad, says in [("lora:r=0,targets=q_proj", "rank"), ("lora:r=8,targets=qq_proj", "unknown target"),
                      ("prefix:r=8", "only LoRA"), ("lora:r=8", "needs r= and targets="),
                      ("lora:r=x,targets=q_proj", "integer"), ("lora:r=8,alpha=-1,targets=q_proj", "alpha"),
                      ("lora:r=8,r=4,targets=q_proj", "each once")]:
        with pytest.raises(ValueError, match=says):
            parse_adapter(bad)


def test_adapter_fits_the_model(model_dir: Path) -> None:
    blocks = load_blocks(model_dir, 0, 2)
    with pytest.raises(ValueError, match="do not exist in this llama model"):
        LoraAdapter(blocks, parse_adapter("lora:r=2,targets=c_attn"), 0)
    with pytest.raises(ValueError, match="exceeds the size"):
        LoraAdapter(blocks, parse_adapter("lora:r=64,targets=q_proj"), 0)


def test_layer_math_and_isolation(model_dir: Path) -> None:
    """Active only inside ``using`` on this thread; the term is (x A^T) B^T * alpha/r on each target."""
    blocks = load_blocks(model_dir, 0, 2)
    adapter = LoraAdapter(blocks, parse_adapter(SPEC), seed=5)
    with torch.no_grad():
        for b in adapter.lora_B.values():
            b.normal_(generator=torch.Generator().manual_seed(1))
    before = [p.clone() for p in blocks.parameters()]
    hidden, pos = _input()
    base, _ = blocks(hidden, pos)
    q = blocks[0].self_attn.q_proj
    x = torch.randn(3, 32)
    with using(adapter.deltas()):
        key = "0-self_attn-q_proj"
        want = x @ q.weight.T + (x @ adapter.lora_A[key].T) @ adapter.lora_B[key].T * 2.0
        torch.testing.assert_close(q(x), want)
        adapted, _ = blocks(hidden, pos)
        seen: list[torch.Tensor] = []
        other = threading.Thread(target=lambda: seen.append(blocks(hidden, pos)[0]))
        other.start()
        other.join()
    assert not torch.equal(adapted, base)
    assert torch.equal(seen[0], base)  # another thread computes with the base model meanwhile
    assert torch.equal(blocks(hidden, pos)[0], base)
    assert all(torch.equal(p, b) for p, b in zip(blocks.parameters(), before, strict=True))


def test_init_does_not_depend_on_the_split(model_dir: Path) -> None:
    whole = LoraAdapter(load_blocks(model_dir, 0, 4), parse_adapter(SPEC), seed=7)
    parts = [LoraAdapter(load_blocks(model_dir, a, b), parse_adapter(SPEC), seed=7) for a, b in ((0, 1), (1, 4))]
    merged = {k: v for part in parts for k, v in part.state_dict().items()}
    assert merged.keys() == whole.state_dict().keys()
    assert all(torch.equal(merged[k], v) for k, v in whole.state_dict().items())
    assert all(not b.any() for b in whole.lora_B.values())  # B starts at zero: the adapted model starts as the base
    other_seed = LoraAdapter(load_blocks(model_dir, 0, 1), parse_adapter(SPEC), seed=8)
    assert not torch.equal(other_seed.lora_A["0-self_attn-q_proj"], whole.lora_A["0-self_attn-q_proj"])


def test_stage_trains_only_its_adapter(model_dir: Path, tmp_path: Path) -> None:
    blocks = load_blocks(model_dir, 1, 3)
    before = [p.clone() for p in blocks.parameters()]
    stage = StageTrainer(blocks, OPTIM, 1, adapter=LoraAdapter(blocks, parse_adapter(SPEC), seed=0))
    assert not any(p.requires_grad for p in blocks.parameters())
    hidden, pos = _input()
    base, _ = blocks(hidden, pos)
    for step in range(2):
        stage.forward(f"m{step}", hidden, pos)
        stage.backward(f"m{step}", torch.ones_like(hidden))
    assert stage.step == 2
    assert all(torch.equal(p, b) for p, b in zip(blocks.parameters(), before, strict=True))
    assert torch.equal(blocks(hidden, pos)[0], base)  # served without the adapter: unchanged
    assert not torch.equal(stage.forward("m9", hidden, pos), base)  # the run's own calls see its adapter
    saved = stage.save(tmp_path / "adapter-1-3")
    again = StageTrainer(blocks, OPTIM, 1, adapter=LoraAdapter(blocks, parse_adapter(SPEC), seed=0))
    assert again.load(saved)["adapter"] == parse_adapter(SPEC).text()
    assert again.step == 2 and all(torch.equal(a, b) for a, b in zip(again.part.params, stage.part.params,
                                                                       strict=True))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_peft_folder_gives_our_logits(tmp_path: Path, family: str) -> None:
    """An adapter saved as a peft folder loads in transformers + peft with our logits, and reads back as it was."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from peers.training import LocalTrainer
    from peers.training.lora_files import read_peft_folder, save_peft_folder

    model_dir = make_tiny_model(tmp_path / family, family=family, hidden_size=32, num_layers=3, num_heads=4,
                                num_kv_heads=2 if family == "llama" else 4, intermediate_size=64, seed=4)
    spec = SPEC if family == "llama" else "lora:r=4,alpha=8,targets=c_attn+c_proj+c_fc"
    local = LocalTrainer(model_dir, OPTIM, 1, stages=[(0, 1), (1, 3)], adapter=spec, seed=3)
    with torch.no_grad():
        for adapter in local.adapters:
            for b in adapter.lora_B.values():
                b.normal_(std=0.05, generator=torch.Generator().manual_seed(2))
    state = {k: v for a in local.adapters for k, v in a.state_dict().items()}
    out = save_peft_folder(tmp_path / "adapter", parse_adapter(spec), model_dir, state)
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), out).eval()
    ids = torch.tensor([[3, 70, 101, 9, 44, 12, 200]])
    with torch.no_grad():
        theirs = model(ids).logits
        ours = local.logits(ids)
        base = model.get_base_model()
        with model.disable_adapter():
            plain = base(ids).logits
    assert (theirs - ours).abs().max() <= 1e-5
    assert (theirs - plain).abs().max() > 1e-3  # the adapter does change the logits
    back_spec, back = read_peft_folder(out)
    assert back_spec == parse_adapter(spec) and back.keys() == state.keys()
    assert all(torch.equal(back[k], v) for k, v in state.items())
