"""Our Llama-family blocks reproduce transformers' Llama, Qwen2 and Mistral logits in fp32."""

from __future__ import annotations

import json

import pytest
import torch

from peers.model import LocalModel, ModelConfig
from peers.model.llama import rope_inv_freq

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=100)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 1000.0, "factor": 4.0}
DYNAMIC_ROPE = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}

CASES = {
    "llama": ("llama", {}),
    "llama-tied-mha": ("llama", dict(tie_word_embeddings=True, num_key_value_heads=4)),
    "llama-bias": ("llama", dict(attention_bias=True, mlp_bias=True, num_key_value_heads=1)),
    "llama3-rope": ("llama", dict(rope_parameters=LLAMA3_ROPE, max_position_embeddings=64)),
    "linear-rope": ("llama", dict(rope_parameters=LINEAR_ROPE)),
    "dynamic-rope": ("llama", dict(rope_parameters=DYNAMIC_ROPE, max_position_embeddings=8)),
    "qwen2": ("qwen2", {}),
    "qwen2-sliding": ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=2)),
    "mistral-sliding": ("mistral", dict(sliding_window=4, head_dim=32, num_hidden_layers=5)),
}


def _build(model_type: str, overrides: dict, randomize) -> torch.nn.Module:
    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[model_type]
    config = cfg_cls(**{**SMALL, **overrides}, attn_implementation="eager")
    torch.manual_seed(0)
    model = model_cls(config)
    randomize(model)
    return model.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers(case: str, tmp_path, hf_check, randomize) -> None:
    model_type, overrides = CASES[case]
    hf = _build(model_type, overrides, randomize)
    hf.save_pretrained(tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.family == "llama" and cfg.model_type == model_type and cfg.name == tmp_path.name
    hf_check(hf, tmp_path, split=2, cache_vs_full=case != "dynamic-rope")


def test_sharded_checkpoint(tmp_path, hf_check, randomize) -> None:
    hf = _build("qwen2", {}, randomize)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 2
    assert (tmp_path / "model.safetensors.index.json").is_file()
    hf_check(hf, tmp_path, split=1)


def test_parsed_config_fields(tmp_path, randomize) -> None:
    hf = _build("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=2), randomize)
    hf.save_pretrained(tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers) == (4, 2, 16, 4)
    assert cfg.attention_bias and not cfg.o_proj_bias and not cfg.mlp_bias
    assert [cfg.sliding_window_for(i) for i in range(4)] == [None, None, 4, 4]
    block_params = sum(p.numel() for p in hf.model.layers[0].parameters())
    assert cfg.block_param_count == block_params
    local = LocalModel.from_dir(tmp_path)
    assert sum(p.numel() for p in local.blocks[0].parameters()) == block_params


def test_old_and_new_rope_layouts_agree(tmp_path, randomize) -> None:
    """transformers 4 wrote rope_theta/rope_scaling at top level; 5 writes rope_parameters."""
    hf = _build("llama", dict(rope_parameters=LLAMA3_ROPE), randomize)
    hf.save_pretrained(tmp_path)
    new = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in new
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    scaling = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    old.update(rope_theta=500000.0, rope_scaling={**scaling, "rope_type": None, "type": "llama3"})
    a, b = ModelConfig.from_dict(new), ModelConfig.from_dict(old)
    assert a == b and a.rope_theta == 500000.0 and a.rope_type == "llama3"
    assert a.rope_scaling["factor"] == 8.0
    ref = hf.model.rotary_emb.inv_freq
    assert torch.equal(rope_inv_freq(a), ref)
    plain = ModelConfig.from_dict({**old, "rope_scaling": None})
    assert plain.rope_type == "default" and not torch.equal(rope_inv_freq(plain), ref)


@pytest.mark.parametrize("bad, match", [
    ({"model_type": "falcon"}, "llama, qwen2, mistral, gpt2"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "unsupported rope_type"),
    ({"num_key_value_heads": 3}, "multiple of num_kv_heads"),
    ({"hidden_act": "swish2"}, "unsupported activation"),
])
def test_config_rejects(bad: dict, match: str) -> None:
    raw = {"model_type": "llama", **SMALL, **bad}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(raw)
