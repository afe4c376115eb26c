"""Config dataclasses: every check made when they are built, and parse_block_indices."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from peers.core.config import ClientConfig, StageServerConfig, SwarmConfig, parse_block_indices

BOOTSTRAP = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooW" + "A" * 44
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")


@pytest.mark.parametrize(
    "text, expected",
    [("0:4", (0, 4)), ("2:6", (2, 6)), ("0:1", (0, 1)), ("10:80", (10, 80)), (" 3 : 5 ", (3, 5))],
)
def test_parse_block_indices(text, expected):
    assert parse_block_indices(text) == expected


@pytest.mark.parametrize(
    "text, match",
    [
        ("", "must look like START:END"),
        ("4", "must look like START:END"),
        ("a:b", "must look like START:END"),
        ("1:2:3", "must look like START:END"),
        ("1.5:3", "must look like START:END"),
        (":4", "must look like START:END"),
        ("0-4", "must look like START:END"),
        ("3:3", "need 0 <= START < END"),
        ("5:2", "need 0 <= START < END"),
        ("-1:2", "need 0 <= START < END"),
    ],
)
def test_parse_block_indices_errors(text, match):
    with pytest.raises(ValueError, match=match):
        parse_block_indices(text)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"new_swarm": True},
        {"initial_peers": [BOOTSTRAP]},
        {"initial_peers": (BOOTSTRAP, BOOTSTRAP.replace("31337", "31338"))},
        {"host_maddrs": ("/ip4/0.0.0.0/tcp/31337",), "dht_timeout": 0.5},
    ],
)
def test_swarm_config_valid(kwargs):
    config = SwarmConfig(**kwargs)
    assert isinstance(config.initial_peers, tuple)
    assert config.initial_peers == tuple(kwargs.get("initial_peers", ()))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"initial_peers": ["/ip4/127.0.0.1/tcp/31337"]}, "lacks /p2p/PEER_ID"),
        ({"initial_peers": [BOOTSTRAP, "/ip4/127.0.0.1/tcp/1"]}, "lacks /p2p/PEER_ID"),
        ({"initial_peers": ["12D3KooW" + "A" * 44]}, "lacks /p2p/PEER_ID"),
        ({"new_swarm": True, "initial_peers": [BOOTSTRAP]}, "not both"),
        ({"dht_timeout": 0}, "dht_timeout must be positive"),
        ({"dht_timeout": -1.0}, "dht_timeout must be positive"),
    ],
)
def test_swarm_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SwarmConfig(**kwargs)


def server(model_dir: Path, **kwargs) -> StageServerConfig:
    kwargs = {"swarm": SwarmConfig(new_swarm=True), "block_indices": (0, 4), **kwargs}
    return StageServerConfig(model_dir=model_dir, **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"block_indices": None, "num_blocks": 3},
        {"swarm": SwarmConfig(initial_peers=(BOOTSTRAP,))},
        {"torch_dtype": "auto"},
        {"torch_dtype": "bfloat16", "max_batch_size": 1, "update_period": 0.5},
    ],
)
def test_server_config_valid(llama_dir, tmp_path, kwargs):
    config = server(str(llama_dir), cache_dir=str(tmp_path), **kwargs)
    assert config.model_dir == llama_dir and isinstance(config.model_dir, Path)
    assert config.cache_dir == tmp_path and isinstance(config.cache_dir, Path)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"block_indices": (0, 4), "num_blocks": 4}, "exactly one of"),
        ({"block_indices": None}, "exactly one of"),
        ({"block_indices": None, "num_blocks": 0}, "--num_blocks must be >= 1"),
        ({"block_indices": None, "num_blocks": -2}, "--num_blocks must be >= 1"),
        ({"torch_dtype": "float64"}, "--torch_dtype must be one of"),
        ({"torch_dtype": "fp16"}, "--torch_dtype must be one of"),
        pytest.param({"device": "cuda"}, "CUDA is not available", marks=NO_CUDA),
        pytest.param({"device": "cuda:1"}, "CUDA is not available", marks=NO_CUDA),
        ({"swarm": SwarmConfig(mdns=False)}, "pass --initial_peers"),  # (with mDNS: refused if none on the LAN)
        ({"max_batch_size": 0}, "max_batch_size must be positive"),
        ({"max_request_bytes": -1}, "max_request_bytes must be positive"),
        ({"request_timeout": 0.0}, "request_timeout must be positive"),
        ({"update_period": -5}, "update_period must be positive"),
    ],
)
def test_server_config_errors(llama_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        server(llama_dir, **kwargs)


@pytest.mark.parametrize("layout", ["empty", "weights_only", "config_dir"])
def test_server_config_needs_config_json(tmp_path, layout):
    if layout == "weights_only":
        (tmp_path / "model.safetensors").write_bytes(b"")
    elif layout == "config_dir":
        (tmp_path / "config.json").mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        server(tmp_path)


def test_server_config_missing_dir(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        server(tmp_path / "nowhere")


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"torch_dtype": "bfloat16"}, {"torch_dtype": "auto", "device": "auto"}, {"max_retries": 0},
     {"request_timeout": 0.1, "model_name": "x"}],
)
def test_client_config_valid(kwargs):
    config = ClientConfig(**kwargs)
    for key, value in kwargs.items():
        assert getattr(config, key) == value


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"torch_dtype": "float64"}, "torch_dtype must be one of"),
        ({"request_timeout": 0}, "request_timeout must be positive"),
        ({"request_timeout": -1.0}, "request_timeout must be positive"),
        ({"max_retries": -1}, "max_retries >= 0"),
    ],
)
def test_client_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ClientConfig(**kwargs)


@pytest.mark.parametrize("cls", [SwarmConfig, StageServerConfig, ClientConfig])
def test_configs_are_keyword_only(cls):
    with pytest.raises(TypeError):
        cls("positional")
