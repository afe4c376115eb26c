"""What ``swarm generate`` prints: temperature 0 is greedy, a split UTF-8 character waits for its bytes and an
incomplete one at the end is shown with a warning; ``swarm train --steps`` past the schedule warns."""

from __future__ import annotations

import io
import logging

import pytest
import torch

from peers.cli.train import steps_warning
from peers.client.generation import SamplingConfig, next_tokens
from peers.client.textgen import TextPieces
from peers.core.devices import resolve_device, resolve_dtype
from peers.model import make_byte_tokenizer
from peers.training import TrainConfig


def test_temperature_zero_is_greedy():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0))
    zero = SamplingConfig(do_sample=True, temperature=0.0, top_k=5, seed=1)
    assert not zero.samples and torch.equal(next_tokens(logits, zero), logits.argmax(-1))
    warm = SamplingConfig(do_sample=True, temperature=1.0, seed=1)
    picks = next_tokens(logits, warm, torch.Generator().manual_seed(1))
    assert not torch.equal(picks, logits.argmax(-1))  # 64 rows of 50 near-uniform tokens: sampling differs
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingConfig(do_sample=True, temperature=-0.5)


def test_cli_temperature_zero_builds_a_greedy_config(fake_generation, tmp_path):
    from peers.cli import commands as cli

    seen = {}

    def stream_text(client, prompt, max_new_tokens, *, sampling):
        seen["sampling"] = sampling
        yield prompt

    fake_generation(stream_text)
    cli.main(["generate", str(tmp_path), "--initial_peers", "/ip4/127.0.0.1/tcp/1/p2p/x", "--prompt", "x",
              "--temperature", "0"])
    assert not seen["sampling"].samples


def _pieces(tokens: list[int]) -> tuple[list[str], str]:
    decoder = TextPieces(make_byte_tokenizer())
    return [decoder.add(t) for t in tokens], decoder.flush()


def test_a_split_character_waits_for_its_bytes():
    pieces, rest = _pieces(list("aé€".encode()))
    assert pieces == ["a", "", "é", "", "", "€"] and rest == ""


def test_an_incomplete_character_at_the_end_is_shown_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="peers.client.textgen"):
        pieces, rest = _pieces([ord("a"), 0xE2, 0x82])
    assert pieces == ["a", "", ""] and rest == "\ufffd"
    assert "ended inside a UTF-8 character" in caplog.text


def test_invalid_bytes_are_not_held_back_forever():
    """64 tokens of byte 195 (a fresh model's output) used to print nothing at all."""
    pieces, rest = _pieces([195] * 64)
    assert "".join(pieces) + rest == "\ufffd" * 64 and sum(1 for p in pieces if p) == 16


def _config(tmp_path, optim: str) -> TrainConfig:
    path = tmp_path / "run.toml"
    path.write_text(f'model_dir = "m"\nsteps = 40\n[optim]\nlr = 1e-3\nmin_lr_ratio = 0.1\n{optim}\n')
    return TrainConfig.from_toml(path)


def test_steps_past_the_schedule_warn_and_say_how_to_extend_it(tmp_path):
    config = _config(tmp_path, 'schedule = "cosine"\ntotal_steps = 40')
    warning = steps_warning(config, 80, "run.toml")
    assert "steps 41..80 all run at the floor lr 0.0001" in warning
    assert "set total_steps = 80 under [optim] in run.toml" in warning
    assert steps_warning(config, 40, "run.toml") == ""
    assert steps_warning(_config(tmp_path, 'schedule = "constant"\ntotal_steps = 40'), 80, "run.toml") == ""
    assert steps_warning(_config(tmp_path, 'schedule = "cosine"'), 80, "run.toml") == ""  # total_steps 0: flat


def test_auto_device_and_dtype_on_this_machine():
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu"
    assert resolve_dtype("auto", "bfloat16", "cpu") == "float32"  # half precision is slow and lossy on CPUs
    assert resolve_dtype("float16", "float32", "cpu") == "float16"  # an explicit choice is kept
    with pytest.raises(ValueError, match="--torch_dtype must be one of"):
        resolve_dtype("fp8", "float32", "cpu")


def test_load_progress_draws_a_bar_on_a_terminal():
    from rich.console import Console

    from peers.core.progress import load_progress

    out = io.StringIO()
    with load_progress(3, "Loading blocks 0:3", Console(file=out, force_terminal=True, width=80)) as advance:
        for _ in range(3):
            advance()
    assert "Loading blocks 0:3" in out.getvalue() and "3/3" in out.getvalue()
    quiet = io.StringIO()
    with load_progress(3, "Loading", Console(file=quiet, force_terminal=False)) as advance:
        advance()
    assert quiet.getvalue() == ""  # no terminal: the logs say it


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_line_never_lands_inside_the_text_on_a_terminal():
    from peers.cli.output import LineBreakingHandler, TextOut

    stdout, stderr = _Tty(), _Tty()
    text = TextOut(stdout)
    handler = LineBreakingHandler(logging.StreamHandler(stderr), stderr, text)
    logger = logging.getLogger("peers.test_output")
    logger.addHandler(handler)
    try:
        text.write("Once upon")
        logger.warning("re-routing blocks 4:8")
        text.write(" a time")
    finally:
        logger.removeHandler(handler)
    assert stdout.getvalue() == "Once upon\n a time" and stderr.getvalue() == "re-routing blocks 4:8\n"
    piped = TextOut(io.StringIO())  # stdout to a file or pipe: the text is never changed
    piped.write("Once")
    handler = LineBreakingHandler(logging.StreamHandler(stderr), stderr, piped)
    handler.handle(logging.LogRecord("x", logging.WARNING, "", 0, "w", None, None))
    assert piped.stream.getvalue() == "Once"
