"""Hugging Face hub ids (``org/name``) resolve in the local HF cache, offline; the swarm name comes from the id."""

from __future__ import annotations

from pathlib import Path

import pytest

from peers.cli import commands as cli
from peers.model import ModelConfig, make_tiny_model
from peers.model.hub import cache_name, resolve_model
from peers.training import TrainConfig

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """A fake HF cache holding ``tiny-org/llama-tiny`` (refs/main -> snapshots/COMMIT), pointed to by HF_HUB_CACHE."""
    cache = tmp_path / "hub"
    repo = cache / "models--tiny-org--llama-tiny"
    make_tiny_model(repo / "snapshots" / COMMIT, family="llama", hidden_size=32, num_layers=2, num_heads=2,
                    num_kv_heads=1, intermediate_size=64, seed=0)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_a_cached_hub_id_resolves_to_its_snapshot_and_is_named_after_the_id(hub_cache):
    folder = resolve_model("tiny-org/llama-tiny")
    assert folder == hub_cache / "models--tiny-org--llama-tiny" / "snapshots" / COMMIT
    assert ModelConfig.from_dir(folder).name == "tiny-org--llama-tiny"  # not the commit hash
    assert cache_name(folder) == "tiny-org--llama-tiny"


def test_a_folder_is_taken_as_it_is(tmp_path, hub_cache):
    folder = make_tiny_model(tmp_path / "here", family="gpt2", hidden_size=32, num_layers=2, num_heads=2,
                             num_kv_heads=2, intermediate_size=64, seed=0)
    assert resolve_model(str(folder)) == folder and ModelConfig.from_dir(folder).name == "here"


def test_hf_home_is_used_when_hf_hub_cache_is_not_set(hub_cache, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # HF_HOME/hub is the cache
    assert resolve_model("tiny-org/llama-tiny").name == COMMIT


def test_an_uncached_hub_id_says_how_to_get_it(hub_cache):
    with pytest.raises(ValueError, match=r"not in the local Hugging Face cache .*`hf download other/model`"):
        resolve_model("other/model")
    with pytest.raises(ValueError, match="neither a model folder nor a Hugging Face hub id"):
        resolve_model("no-such-folder")


def test_commands_take_hub_ids(hub_cache, tmp_path, capsys):
    # a peer: the hub id reaches the server's config as the snapshot folder (which then asks for a swarm to join)
    assert cli.main(["peer", "tiny-org/llama-tiny", "--num_blocks", "1"]) == 2
    err = capsys.readouterr().err
    assert "pass --initial_peers" in err and "config.json" not in err
    assert cli.main(["status", "other/model", "--initial_peers", "/ip4/127.0.0.1/tcp/1/p2p/x"]) == 2
    assert "hf download other/model" in capsys.readouterr().err
    config = tmp_path / "run.toml"
    config.write_text('model_dir = "tiny-org/llama-tiny"\nseq_len = 8\nbatch_size = 2\nmicro_batch = 2\n'
                      'data = "corpus.txt"\n')
    loaded = TrainConfig.from_toml(config)
    assert loaded.model_dir == resolve_model("tiny-org/llama-tiny") and loaded.data == tmp_path / "corpus.txt"


def test_model_name_is_on_every_command_that_names_a_model():
    from peers.cli.parsing import subcommand_parsers

    parsers = subcommand_parsers(cli._parser())
    for name in ("peer", "status", "generate", "train", "export"):
        assert "--model_name" in parsers[name]._option_string_actions, name
    args = cli._parser().parse_args(["generate", "tiny-org/llama-tiny", "--prompt", "x", "--model_name", "m"])
    assert args.model_name == "m" and args.model_dir == "tiny-org/llama-tiny"

