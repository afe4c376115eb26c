"""Shared fixtures: tiny model folders made locally (no downloads); the ``swarm`` command run in this process."""

from __future__ import annotations

import contextlib
import io
import logging
import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from peers.cli import main
from peers.cli.launch import LocalSwarm
from peers.model import make_tiny_model


@pytest.fixture(autouse=True, scope="session")
def _small_link_probes() -> None:
    """Stage peers started by tests probe with 1 MiB only (``--probe_max_mib 1``): on loopback every probe would
    grow to 16 MiB, and a swarm of 8 peers would spend seconds of CPU sealing them. A test that reads rates sets
    its ``LocalSwarm``'s ``probe_max_mib`` back to None."""
    LocalSwarm.probe_max_mib = 1


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "llama-tiny", family="llama", hidden_size=64,
                           num_layers=8, num_heads=4, num_kv_heads=2, intermediate_size=128, seed=1)


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "gpt2-tiny", family="gpt2", hidden_size=64,
                           num_layers=6, num_heads=4, num_kv_heads=4, intermediate_size=256, seed=2)


def run_cli(*args: str, umask: int | None = None, env: dict[str, str] | None = None) -> SimpleNamespace:
    """Run ``swarm ARGS`` in this process (a fresh process spends seconds importing torch and hivemind), under
    ``umask`` and extra environment variables ``env`` if given: its exit code, stdout and stderr (where its logging
    goes), as ``subprocess.run(..., capture_output=True, text=True)`` gives them. What the command changes of this
    process is put back afterwards: the umask, the environment and the loggers it sets up (later tests' caplog
    still sees their records)."""
    loggers = [logging.getLogger(name) for name in ("peers", "swarm", "privacy", "hivemind")]
    saved = [(lg.handlers[:], lg.level, lg.propagate) for lg in loggers]
    old_env = {key: os.environ.get(key) for key in env or {}}
    old_umask = os.umask(umask) if umask is not None else None
    os.environ.update(env or {})
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    finally:
        if old_umask is not None:
            os.umask(old_umask)
        for key, value in old_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for lg, (handlers, level, propagate) in zip(loggers, saved, strict=True):
            lg.handlers[:], lg.propagate = handlers, propagate
            lg.setLevel(level)
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


@pytest.fixture
def swarm_cli() -> Callable[..., SimpleNamespace]:
    """``run_cli``: the ``swarm`` command in this process."""
    return run_cli
