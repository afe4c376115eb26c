"""``swarm new-model``: a loadable from-scratch model, the same for the same seed, never over an existing one."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from peers.cli.commands import main
from peers.model import LocalModel

ARGS = ["--hidden_size", "64", "--num_layers", "3", "--num_heads", "4", "--max_position_embeddings", "128"]


def test_new_model_loads_and_runs(tmp_path, capsys):
    path = tmp_path / "scratch"
    assert main(["new-model", str(path), *ARGS]) == 0
    assert "swarm peer" in capsys.readouterr().out
    config = json.loads((path / "config.json").read_text())
    assert config["num_hidden_layers"] == 3 and config["hidden_size"] == 64 and config["num_key_value_heads"] == 2
    assert (path / "tokenizer.json").is_file()
    logits, _ = LocalModel.from_dir(path)(torch.tensor([list(b"hello")]))
    assert logits.shape[:2] == (1, 5) and bool(torch.isfinite(logits).all())


def test_same_seed_same_weights_and_no_overwrite(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for path, seed in ((a, "1"), (b, "1"), (c, "2")):
        assert main(["new-model", str(path), *ARGS, "--seed", seed]) == 0
    wa, wb, wc = (load_file(str(p / "model.safetensors")) for p in (a, b, c))
    assert all(torch.equal(wa[k], wb[k]) for k in wa) and not all(torch.equal(wa[k], wc[k]) for k in wa)

    before = (a / "model.safetensors").read_bytes()
    assert main(["new-model", str(a), *ARGS, "--seed", "2"]) == 2  # refused: a model is there
    assert (a / "model.safetensors").read_bytes() == before
    assert main(["new-model", str(a), *ARGS, "--seed", "2", "--force"]) == 0
    assert all(torch.equal(load_file(str(a / "model.safetensors"))[k], wc[k]) for k in wc)
    assert main(["new-model", str(tmp_path / "bad"), "--hidden_size", "0"]) == 2


def test_defaults_make_the_demo_model(tmp_path):
    from peers.cli.demo import ensure_demo_model

    assert main(["new-model", str(tmp_path / "cli")]) == 0
    demo = ensure_demo_model(tmp_path / "demo")
    assert json.loads((tmp_path / "cli" / "config.json").read_text()) == json.loads((demo / "config.json").read_text())
    ours, theirs = load_file(str(tmp_path / "cli" / "model.safetensors")), load_file(str(demo / "model.safetensors"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
