"""What a newcomer reads from the ``swarm`` command when something is off (issue 10's small defects)."""

from __future__ import annotations

import pytest

from peers.cli import commands as cli


@pytest.mark.parametrize("value, message", [("5:3", "need 0 <= START < END"), ("abc", "must look like START:END")])
def test_bad_block_indices_say_what_is_wrong(value, message, capsys, tmp_path):
    with pytest.raises(SystemExit):
        cli.main(["peer", str(tmp_path), "--block_indices", value, "--new_swarm"])
    err = capsys.readouterr().err
    assert message in err and "invalid parse_block_indices value" not in err


def test_a_failed_generation_prints_its_error_on_a_line_of_its_own(fake_generation, capsys, tmp_path):
    """The echoed prompt ends its line before the error is logged (the error used to follow the prompt)."""
    def stream_text(*args, **kwargs):
        yield "Once upon"
        raise RuntimeError("blocks 0:4 failed 4 times")

    fake_generation(stream_text)
    code = cli.main(["generate", str(tmp_path), "--initial_peers", "/ip4/127.0.0.1/tcp/1/p2p/x", "--prompt", "Once"])
    assert code == 2 and capsys.readouterr().out == "Once upon\n"
