"""``peers.model.export``: parts loaded from a model folder and written back give the folder's own tensors, under the
same names (tied heads once), with the tokenizer and config copied."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from peers.model import ModelConfig, load_blocks, load_client_parts
from peers.model.export import hf_tensors, save_hf_folder


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_round_trip_gives_the_folders_tensors(family, llama_dir, gpt2_dir, tmp_path):
    model_dir = llama_dir if family == "llama" else gpt2_dir
    embedding, head = load_client_parts(model_dir)
    blocks = list(load_blocks(model_dir, 0, ModelConfig.from_dir(model_dir).num_layers))
    out = save_hf_folder(model_dir, tmp_path / "out", hf_tensors(model_dir, embedding, head, blocks),
                         info={"run_id": "r"})
    original, written = load_file(str(model_dir / "model.safetensors")), load_file(str(out / "model.safetensors"))
    if ModelConfig.from_dir(model_dir).tie_word_embeddings:
        original.pop("lm_head.weight", None)
    assert written.keys() == original.keys()
    assert all(torch.equal(written[k], original[k].float()) for k in original)
    assert (out / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    assert json.loads((out / "export.json").read_text()) == {"run_id": "r"}
    with pytest.raises(ValueError, match="not empty"):
        save_hf_folder(model_dir, out, written)
    with pytest.raises(ValueError, match="got 1 blocks"):
        hf_tensors(model_dir, embedding, head, blocks[:1])
