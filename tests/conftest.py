"""Shared fixtures: tiny model folders made locally (no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest

from peers.model import make_tiny_model


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "llama-tiny", family="llama", hidden_size=64,
                           num_layers=8, num_heads=4, num_kv_heads=2, intermediate_size=128, seed=1)


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "gpt2-tiny", family="gpt2", hidden_size=64,
                           num_layers=6, num_heads=4, num_kv_heads=4, intermediate_size=256, seed=2)
