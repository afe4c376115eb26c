"""The testbed's pure parts: matrices and their rate classes, the tc commands, the NAT ruleset, the CLI's parser."""

from __future__ import annotations

import pytest

from swarm.testbed.__main__ import parser
from swarm.testbed.matrices import GBIT, MATRICES, MBIT, Matrix, rate_classes, resolve_matrix
from swarm.testbed.nat import nat_ruleset
from swarm.testbed.shaping import UNSHAPED, download_commands, leaf_minor, leaf_queue, tc_rate, upload_commands

INF = float("inf")


@pytest.mark.parametrize("name, n, src, dst, rate", [
    ("lan", 2, 0, 1, 1 * GBIT),
    ("lan", 6, 5, 0, 1 * GBIT),
    ("three_sites", 6, 0, 1, 10 * GBIT),   # site-a inside
    ("three_sites", 6, 4, 5, 10 * GBIT),   # site-c inside
    ("three_sites", 6, 0, 2, 100 * MBIT),  # a -> b
    ("three_sites", 6, 3, 1, 100 * MBIT),  # b -> a
    ("three_sites", 6, 1, 4, 8 * MBIT),    # a -> c
    ("three_sites", 6, 5, 2, 8 * MBIT),    # c -> b
    ("three_sites", 9, 2, 3, 100 * MBIT),  # 9 hosts: 3 a site
    ("home", 3, 0, 1, 10 * MBIT),          # min(10 up, 50 down)
])
def test_named_matrix_rates(name, n, src, dst, rate):
    assert MATRICES[name].rate(src, dst, n) == rate


@pytest.mark.parametrize("n, sites", [
    (6, ["site-a", "site-a", "site-b", "site-b", "site-c", "site-c"]),
    (3, ["site-a", "site-b", "site-c"]),
    (2, ["site-a", "site-b"]),
    (7, ["site-a", "site-a", "site-a", "site-b", "site-b", "site-c", "site-c"]),
])
def test_three_sites_split(n, sites):
    assert [MATRICES["three_sites"].site(i, n) for i in range(n)] == sites


@pytest.mark.parametrize("matrix, n, expected", [
    ("lan", 2, [("pair", 1 * GBIT, [0], 1)]),
    ("three_sites", 6, [("pair", 8 * MBIT, [0], 4), ("pair", 100 * MBIT, [0], 2), ("pair", 10 * GBIT, [0], 1)]),
    # 6 uploads of 10 exceed one download of 50: the download class shows only with everyone sending at once
    ("home", 7, [("download", 50 * MBIT, [1, 2, 3, 4, 5, 6], 0), ("pair", 10 * MBIT, [0], 1)]),
    # 5 uploads of 10 do not exceed 50: no download class to measure
    ("home", 6, [("pair", 10 * MBIT, [0], 1)]),
    ({(0, 1): 5 * MBIT}, 2, [("pair", INF, [1], 0), ("pair", 5 * MBIT, [0], 1)]),
])
def test_rate_classes(matrix, n, expected):
    got = [(c["kind"], c["rate"], c["senders"], c["receiver"]) for c in rate_classes(resolve_matrix(matrix), n)]
    assert got == sorted(expected, key=lambda c: (c[0], c[1]))


@pytest.mark.parametrize("given, src, dst, rate", [
    ({(0, 1): 5e6}, 0, 1, 5e6),
    ({(0, 1): 5e6}, 1, 0, INF),
    (lambda i, j: 1e6 * (i + j), 1, 2, 3e6),
    (lambda i, j: None, 1, 2, INF),
    (None, 0, 1, INF),
    (Matrix("m", "d", up=lambda i, n: 7.0, down=lambda i, n: 3.0 if i == 1 else None), 0, 1, 3.0),
    (Matrix("m", "d", up=lambda i, n: 7.0, down=lambda i, n: 3.0 if i == 1 else None), 1, 0, 7.0),
])
def test_custom_matrices(given, src, dst, rate):
    assert resolve_matrix(given).rate(src, dst, 3) == rate


@pytest.mark.parametrize("bad, message", [
    ("wan", "unknown matrix 'wan'"),
    ({(0, 0): 1e6}, "two different hosts"),
    ({(0, 1): 0}, "rate > 0"),
    (42, "a matrix is a name"),
])
def test_bad_matrices_are_refused_with_a_reason(bad, message):
    with pytest.raises((ValueError, TypeError), match=message):
        resolve_matrix(bad)


def test_upload_commands_shape_each_destination_under_the_upload():
    cmds = upload_commands("eth0", 10 * MBIT, {"10.1.0.10": 100 * MBIT, "10.1.0.2": 8 * MBIT})
    text = [" ".join(c) for c in cmds]
    assert text[0] == "tc qdisc add dev eth0 root handle 1: htb default fffe"
    assert "classid 1:1 htb rate 10000000bit ceil 10000000bit" in text[1]
    assert "classid 1:fffe htb rate 10000000bit" in text[2]  # unclassified traffic: the upload rate
    assert text[3] == "tc qdisc add dev eth0 parent 1:fffe bfifo limit 134100"  # 2 x 64 KiB + 2 frames > 50 ms
    # sorted by address (10.1.0.2 before 10.1.0.10); a pair above the upload is capped at the upload
    assert "parent 1:1 classid 1:10 htb rate 8000000bit ceil 8000000bit" in text[4]
    assert text[5] == "tc qdisc add dev eth0 parent 1:10 bfifo limit 134100"
    assert text[6].endswith("u32 match ip dst 10.1.0.2/32 flowid 1:10")
    assert "classid 1:11 htb rate 10000000bit ceil 10000000bit" in text[7]
    assert text[9].endswith("u32 match ip dst 10.1.0.10/32 flowid 1:11")
    assert len(cmds) == 10


@pytest.mark.parametrize("up, pairs, first_rate, burst", [
    (None, {"10.0.0.2": 10 * GBIT}, tc_rate(UNSHAPED), True),   # no upload limit: the root stands for "none"
    (None, {}, None, None),                                     # nothing to shape: no qdisc at all
    (10 * MBIT, {}, tc_rate(10 * MBIT), False),                 # slow classes keep htb's default burst
    (1 * GBIT, {}, tc_rate(1 * GBIT), True),                    # fast ones get 2 ms of traffic
])
def test_upload_commands_table(up, pairs, first_rate, burst):
    cmds = upload_commands("eth0", up, pairs)
    if first_rate is None:
        assert cmds == []
        return
    root = cmds[1]
    assert root[root.index("rate") + 1] == first_rate
    assert ("burst" in root) == burst
    if burst:
        assert int(root[root.index("burst") + 1]) == int(float(first_rate[:-3]) / 8 * 0.002)


def test_download_commands():
    assert download_commands("h3", None) == []
    cmds = download_commands("h3", 50 * MBIT)
    assert " ".join(cmds[0]) == "tc qdisc add dev h3 root handle 1: htb default 1"
    assert "classid 1:1 htb rate 50000000bit ceil 50000000bit" in " ".join(cmds[1])
    assert " ".join(cmds[2]) == "tc qdisc add dev h3 parent 1:1 bfifo limit 312500"  # 50 ms at 50 Mbit/s


@pytest.mark.parametrize("rate, limit", [
    (8 * MBIT, 2 * 65536 + 2 * 1514),  # 50 ms would be 50 kB: less than two offloaded 64 KiB packets
    (100 * MBIT, 625_000),             # 50 ms of traffic
    (10 * GBIT, 1000 * 1514),          # capped at the device's own queue (1,000 frames)
    (UNSHAPED, 1000 * 1514),
])
def test_leaf_queues_hold_50_ms_within_bounds(rate, limit):
    argv = leaf_queue("eth0", "1:10", rate)
    assert argv[:7] == ["tc", "qdisc", "add", "dev", "eth0", "parent", "1:10"] and argv[7:] == ["bfifo", "limit",
                                                                                               str(limit)]


@pytest.mark.parametrize("index, minor", [(0, 16), (5, 21), (1000, 1016)])
def test_leaf_minor(index, minor):
    assert leaf_minor(index) == minor


def test_leaf_minor_out_of_range():
    with pytest.raises(ValueError, match="out of range"):
        leaf_minor(70000)


def test_nat_ruleset_masquerades_out_and_forwards_nothing_new_in():
    rules = nat_ruleset("eth0", "lan0", "t")
    assert rules.startswith("table ip t {")
    assert 'oifname "eth0" masquerade' in rules
    assert "policy drop;" in rules and "ct state established,related accept" in rules
    assert 'iifname "lan0" oifname "eth0" accept' in rules
    assert 'iifname "eth0" oifname "lan0" accept' not in rules


@pytest.mark.parametrize("argv, command", [
    (["up", "--hosts", "6", "--matrix", "three_sites"], "up"),
    (["verify", "--matrix", "home"], "verify"),
    (["cleanup", "--force"], "cleanup"),
    (["matrices"], "matrices"),
])
def test_cli_parses(argv, command):
    assert parser().parse_args(argv).command == command


def test_cli_help_says_there_is_no_latency(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["--help"])
    assert "No latency is emulated" in capsys.readouterr().out


@pytest.mark.parametrize("kwargs, message", [
    ({"hosts": 0}, "1 to 199 hosts"),
    ({"hosts": 200}, "1 to 199 hosts"),
    ({"prefix": "Bad-Prefix"}, "lower-case letters and digits"),
    ({"prefix": "a" * 17}, "1-16"),
    ({"matrix": "wan"}, "unknown matrix"),
])
def test_testbed_arguments_are_checked_before_anything_is_made(kwargs, message):
    from swarm.testbed import Testbed

    with pytest.raises(ValueError, match=message):
        Testbed(**kwargs)


def test_a_testbed_that_is_not_running_says_so():
    from swarm.testbed import Host, Testbed, TestbedError

    tb = Testbed(2)
    with pytest.raises(TestbedError, match="inside `with Testbed"):
        tb.spawn(Host("h0", "x-h0", "10.1.0.1", "lan"), ["true"])
    tb.close()  # closing one that never started is a no-op


@pytest.mark.parametrize("euid, tools, reason_root, reason_nft", [
    (0, {"ip", "tc", "nft"}, None, None),
    (1000, {"ip", "tc", "nft"}, "needs root", "needs root"),
    (0, {"ip", "tc"}, None, "apt-get install -y nftables"),
    (0, {"ip", "nft"}, "apt-get install -y iproute2", "apt-get install -y iproute2"),
])
def test_skip_reasons(monkeypatch, euid, tools, reason_root, reason_nft):
    from swarm.testbed import netns

    monkeypatch.setattr(netns.os, "geteuid", lambda: euid)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: f"/usr/sbin/{tool}" if tool in tools else None)
    for got, want in ((netns.require_root(), reason_root), (netns.require_nft(), reason_nft)):
        assert (got is None) if want is None else (want in got)


def test_starting_without_root_is_a_clear_error(monkeypatch):
    from swarm.testbed import Testbed, TestbedError, netns

    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(TestbedError, match="cannot make a testbed: needs root"):
        Testbed(2).start()


def test_a_testbed_starts_once(monkeypatch):
    from swarm.testbed import Host, Testbed, TestbedError

    tb = Testbed(2)
    tb.hosts.append(Host("h0", "x-h0", "10.1.0.1", "lan"))  # as after a run
    with pytest.raises(TestbedError, match="started already"):
        tb.start()
