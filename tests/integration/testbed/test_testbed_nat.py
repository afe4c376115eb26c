"""The NAT host dials out to the bridge's hosts (seen as its router) and cannot be dialled from them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from swarm.testbed import Testbed

SERVE = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(4); print("ready", flush=True)
s.settimeout(20)
c, peer = s.accept(); c.sendall(("hello " + peer[0]).encode()); c.close()
"""
DIAL = """
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
    print(c.recv(100).decode())
except OSError as e:
    print(f"failed {type(e).__name__} {e}")
"""


def _serve(tb: Testbed, host, port: int) -> subprocess.Popen:
    proc = tb.popen(host, [sys.executable, "-c", SERVE, str(port)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _dial(tb: Testbed, host, address: str, port: int, timeout: float = 2.0) -> str:
    return tb.run(host, [sys.executable, "-c", DIAL, address, str(port), str(timeout)]).stdout.strip()


@pytest.fixture
def nat_testbed(needs_nft):
    with Testbed(2, "lan") as tb:
        yield tb, tb.add_nat_host()


def test_the_nat_host_dials_out_as_its_router(nat_testbed):
    tb, nat = nat_testbed
    server = _serve(tb, tb.hosts[0], 7001)
    assert _dial(tb, nat, tb.hosts[0].address, 7001) == f"hello {nat.public_address}"  # masqueraded
    server.wait(5)


def test_the_bridge_hosts_cannot_dial_the_nat_host(nat_testbed):
    tb, nat = nat_testbed
    h0 = tb.hosts[0]
    server = _serve(tb, nat, 7002)
    # the router's own address has no port forwarding: refused at once
    assert _dial(tb, h0, nat.public_address, 7002).startswith("failed ConnectionRefusedError")
    # the inside address is not routed from the bridge ...
    assert _dial(tb, h0, nat.address, 7002).startswith("failed OSError [Errno 101]")  # network unreachable
    # ... and even with a route through the router, nothing new is forwarded inwards
    tb.run(h0, ["ip", "route", "add", nat.address.rsplit(".", 1)[0] + ".0/24", "via", nat.public_address])
    assert _dial(tb, h0, nat.address, 7002, timeout=1.5).startswith("failed TimeoutError")
    # the listener was there all along: the NAT host reaches itself
    assert _dial(tb, nat, nat.address, 7002) == f"hello {nat.address}"
    server.wait(5)
