"""The NAT and relay flags of each ``swarm`` command, and their defaults per kind of command (table test)."""

from __future__ import annotations

import pytest

from peers.cli.commands import _parser
from peers.cli.options import swarm_config

BOOT = "/ip4/1.2.3.4/tcp/31337/p2p/12D3KooWFpbssVJyMjAxR1t8g32zQT7sprY1LGoWNqXvreHNTk9z"
JOIN = ["--initial_peers", BOOT]


def config(argv: list[str]):
    return swarm_config(_parser().parse_args(argv))


@pytest.mark.parametrize(("argv", "expected"), [
    # a bootstrap peer: relays for others with long limits (forced public), never takes slots itself
    (["dht"], dict(use_relay=True, use_auto_relay=False, force_reachability="public", client_mode=False)),
    (["dht", "--force_reachability", "auto"], dict(force_reachability=None)),
    (["dht", "--no_relay"], dict(use_relay=False)),
    # a home peer: checked, behind NAT it serves through its relays
    (["peer", "m", *JOIN, "--num_blocks", "1"],
     dict(use_relay=True, use_auto_relay=True, force_reachability=None, client_mode=False, relays=())),
    (["peer", "m", *JOIN, "--num_blocks", "1", "--no_relay"], dict(use_relay=False)),
    (["peer", "m", *JOIN, "--num_blocks", "1", "--no_auto_relay"], dict(use_relay=True, use_auto_relay=False)),
    (["peer", "m", *JOIN, "--num_blocks", "1", "--force_reachability", "private", "--relays", BOOT],
     dict(force_reachability="private", relays=(BOOT,))),
    (["peer", "m", *JOIN, "--num_blocks", "1", "--client_mode"], dict(client_mode=True)),
    # clients only dial out
    (["generate", "m", *JOIN, "--prompt", "x"], dict(use_relay=True, use_auto_relay=False, client_mode=True)),
    (["generate", "m", *JOIN, "--prompt", "x", "--no_relay"], dict(use_relay=False)),
    (["status", "m", *JOIN], dict(use_auto_relay=False, client_mode=True)),
    (["train", "c.toml", *JOIN], dict(use_auto_relay=False, client_mode=True)),
])
def test_flags_and_defaults(argv, expected):
    swarm = config(argv)
    for name, value in expected.items():
        assert getattr(swarm, name) == value, name


def test_no_relay_means_no_slots_either():
    nat = config(["peer", "m", *JOIN, "--num_blocks", "1", "--no_relay"]).nat()
    assert not nat.use_relay and not nat.use_auto_relay


def test_a_bad_relay_is_refused_with_what_to_pass():
    with pytest.raises(ValueError, match="full address"):
        config(["peer", "m", *JOIN, "--num_blocks", "1", "--relays", "/ip4/1.2.3.4/tcp/1"])
