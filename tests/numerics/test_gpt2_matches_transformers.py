"""Our GPT-2 blocks reproduce transformers' GPT2LMHeadModel logits in fp32."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from peers.model import GPT2Block, LocalModel, ModelConfig, load_blocks, load_client_parts

transformers = pytest.importorskip("transformers")


def _build(randomize, **overrides) -> torch.nn.Module:
    kw = dict(n_embd=64, n_layer=4, n_head=4, n_positions=32, vocab_size=100, attn_implementation="eager")
    config = transformers.GPT2Config(**{**kw, **overrides})
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    randomize(model)
    return model.eval()


@pytest.mark.parametrize("overrides", [
    {},
    {"n_inner": 96, "activation_function": "gelu"},
    {"activation_function": "gelu_pytorch_tanh", "n_layer": 6},
], ids=["gelu_new", "n_inner-gelu", "tanh-6-layers"])
def test_matches_transformers(overrides: dict, tmp_path, hf_check, randomize) -> None:
    hf = _build(randomize, **overrides)
    hf.save_pretrained(tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.family == "gpt2" and cfg.tie_word_embeddings
    assert cfg.intermediate_size == overrides.get("n_inner", 4 * 64)
    hf_check(hf, tmp_path, split=3)


def test_sharded_checkpoint(tmp_path, hf_check, randomize) -> None:
    hf = _build(randomize)
    hf.save_pretrained(tmp_path, max_shard_size="60KB")
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 2
    hf_check(hf, tmp_path, split=1)


def test_bare_keys_of_original_checkpoints(tmp_path, hf_check, randomize) -> None:
    """Original GPT-2 checkpoints use ``h.{i}.`` / ``wte`` keys and carry attention-mask buffers."""
    hf = _build(randomize)
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    bare = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    assert "h.0.ln_1.weight" in bare and "wte.weight" in bare and "lm_head.weight" not in bare
    for i in range(4):
        bare[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 32, 32))
    save_file(bare, tmp_path / "model.safetensors", metadata={"format": "pt"})
    hf_check(hf, tmp_path, split=2)


def test_conv1d_layout_and_tied_head(tmp_path, randomize) -> None:
    hf = _build(randomize)
    hf.save_pretrained(tmp_path)
    block = load_blocks(tmp_path, 1, 2)[0]
    assert isinstance(block, GPT2Block)
    ref = hf.transformer.h[1]
    assert torch.equal(block.attn.c_attn.weight, ref.attn.c_attn.weight)  # [in, out] as in the checkpoint
    assert block.mlp.c_fc.weight.shape == (64, 256)
    emb, head = load_client_parts(tmp_path)
    assert head.lm_head.weight is emb.wte.weight
    assert torch.equal(emb.wpe.weight, hf.transformer.wpe.weight)


def test_position_ids_matter_and_are_bounded(tmp_path, randomize) -> None:
    hf = _build(randomize)
    hf.save_pretrained(tmp_path)
    model = LocalModel.from_dir(tmp_path)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        a, _ = model(ids)
        b, _ = model(ids, position_ids=torch.tensor([[3, 4, 5]]))
        ref = hf(ids, position_ids=torch.tensor([[3, 4, 5]])).logits
    assert (a - b).abs().max() > 1e-3
    assert (b - ref).abs().max() < 1e-4
    with pytest.raises(ValueError, match="32 learned positions"):
        model(ids, position_ids=torch.tensor([[30, 31, 32]]))


def test_rejects_unsupported_gpt2_options() -> None:
    raw = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 10}
    assert ModelConfig.from_dict(raw).num_kv_heads == 4
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        ModelConfig.from_dict({**raw, "scale_attn_by_inverse_layer_idx": True})
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig.from_dict({**raw, "n_head": 5})
