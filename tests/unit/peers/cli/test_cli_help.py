"""``swarm --help`` explains itself: every flag of every subcommand has help that shows its default, and typos get a
"did you mean"."""

from __future__ import annotations

import argparse

import pytest

from peers.cli import commands as cli
from peers.cli.parsing import HelpFormatter, subcommand_parsers

SWITCHES = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._HelpAction)


def _flags():
    for name, parser in subcommand_parsers(cli._parser()).items():
        for action in parser._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                yield name, parser, action


def test_every_flag_has_help_that_shows_its_default():
    missing, silent = [], []
    for name, parser, action in _flags():
        flag = f"swarm {name} {action.option_strings[-1]}"
        if not action.help:
            missing.append(flag)
            continue
        if isinstance(action, SWITCHES) or action.required:  # off (or on) unless given / always given
            continue
        shown = HelpFormatter(parser.prog)._get_help_string(action)
        if "default" not in shown and "required" not in shown:  # required: one of a group
            silent.append(flag)
    assert not missing, f"flags without help: {missing}"
    assert not silent, f"flags whose help hides the default: {silent}"


def test_defaults_are_rendered_in_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["peer", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for text in ("--device DEVICE", "(default: auto)", "--cache_tokens CACHE_TOKENS", "(default: 16384)",
                 "--request_timeout REQUEST_TIMEOUT", "(default: 60.0)"):
        assert text in out


def test_devices_default_to_auto():
    parser = cli._parser()
    for argv in (["peer", "m", "--new_swarm", "--num_blocks", "1"], ["generate", "m", "--prompt", "x"]):
        args = parser.parse_args(argv)
        assert (args.device, args.torch_dtype) == ("auto", "auto")


@pytest.mark.parametrize("argv, hint", [
    (["genrate", "m"], "did you mean 'generate'?"),
    (["generate", "m", "--prompt", "x", "--temprature", "0"], "--temprature: did you mean --temperature?"),
    (["generate", "m", "--prompt", "x", "--max_new_tokns=3"], "--max_new_tokns: did you mean --max_new_tokens?"),
    (["peer", "m", "--new_swarm", "--num_blocks", "1", "--torch_dtype", "flaot16"], "did you mean 'float16'?"),
])
def test_typos_get_a_did_you_mean(argv, hint, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert hint in capsys.readouterr().err


def test_an_unknown_flag_with_nothing_near_points_to_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["status", "m", "--zzzzzz"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --zzzzzz" in err and "swarm status --help" in err
