"""check_ports_free and IdentityClaim on real sockets and files (issue 15, findings 13 and 14)."""

from __future__ import annotations

import socket

import pytest

from swarm.startup_checks import IdentityClaim, StartupRefused, check_ports_free


def test_finding_14_a_listening_tcp_port_is_refused_with_its_address():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        maddr = f"/ip4/127.0.0.1/tcp/{taken.getsockname()[1]}"
        with pytest.raises(StartupRefused, match=f"--host_maddrs {maddr}: TCP port .* already in use.*choose another"):
            check_ports_free(["/ip4/127.0.0.1/tcp/0", maddr])


def test_finding_14_a_bound_udp_port_is_refused():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        maddr = f"/ip4/127.0.0.1/udp/{taken.getsockname()[1]}/quic-v1"
        with pytest.raises(StartupRefused, match="UDP port"):
            check_ports_free([maddr])


def test_finding_14_a_port_left_in_time_wait_by_our_last_run_is_free():
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Go's listeners (libp2p's) do
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()  # the listening side closes first: its end stays in TIME_WAIT
    client.close()
    check_ports_free([f"/ip4/127.0.0.1/tcp/{port}"])
    check_ports_free(["/ip4/127.0.0.1/tcp/0", "/ip6/::1/tcp/0", "/dns/example.com/tcp/443"])  # nothing fixed here


def test_finding_13_an_identity_file_is_claimed_once_until_released(tmp_path):
    path = tmp_path / "node.id"
    path.write_bytes(b"key")
    first = IdentityClaim(path)
    with pytest.raises(StartupRefused, match=f"identity file {path} is already used .* --identity_path NEW_FILE"):
        IdentityClaim(path)
    first.release()
    IdentityClaim(path).release()
