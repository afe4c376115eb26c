"""DHT key formats: model names that may become keys, and the peers key."""

from __future__ import annotations

import pytest

from swarm.keys import KEY_PREFIX, check_model_name, peers_key


@pytest.mark.parametrize(
    "name",
    ["a", "llama-tiny", "Meta-Llama-3.1-8B-Instruct", "gpt2_tiny.v2", "Qwen2.5-0.5B", "x" * 128, "0", "a.b-c_d"],
)
def test_accepted_model_names(name):
    assert check_model_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        "x" * 129,
        "two words",
        "org/model",
        "model:v1",
        "model\n",  # `$` of a plain re.match would let a final newline through
        "\nmodel",
        "model\x00",
        "mödel",
        "model*",
        "model,other",
    ],
    ids=repr,
)
def test_refused_model_names(name):
    with pytest.raises(ValueError, match="must match"):
        check_model_name(name)


@pytest.mark.parametrize("name", [None, 5, b"llama"])
def test_non_string_model_name(name):
    with pytest.raises(ValueError):
        check_model_name(name)


@pytest.mark.parametrize(
    "model, key",
    [
        ("llama-tiny", "fusionswarm.v1.llama-tiny.peers"),
        ("Meta-Llama-3.1-8B", "fusionswarm.v1.Meta-Llama-3.1-8B.peers"),
        ("a", "fusionswarm.v1.a.peers"),
    ],
)
def test_peers_key(model, key):
    assert KEY_PREFIX == "fusionswarm.v1"
    assert peers_key(model) == key


def test_peers_keys_differ_by_model():
    models = ["a", "b", "llama", "llama-tiny", "llama.tiny"]
    assert len({peers_key(m) for m in models}) == len(models)


@pytest.mark.parametrize("model", ["", "a/b", "bad name", "m\n"], ids=repr)
def test_peers_key_refuses_bad_model(model):
    with pytest.raises(ValueError):
        peers_key(model)
