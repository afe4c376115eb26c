"""Refuse to start a node that would be unreachable or would share its peer id with another running node.

* :func:`check_ports_free`: libp2p listens with ``SO_REUSEPORT``, so a second daemon on a port another one
  already serves starts happily and shares the port's connections with it; we bind each fixed port first.
* :class:`IdentityClaim`: an exclusive lock on the identity file for as long as the node runs, so a second
  process on this machine started with the same ``--identity_path`` is refused.
* :func:`check_identity_offline`: asks the swarm whether a node with our peer id is online already (a copy
  of the identity file on another machine), as hivemind's ``check_if_identity_free`` would for RSA keys only.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
from collections.abc import Sequence
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; the swarm-wide check still applies
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

_FAMILIES = {"ip4": socket.AF_INET, "ip6": socket.AF_INET6}


class StartupRefused(RuntimeError):
    """This node must not start; the message says why and what to do."""


def _fixed_ports(maddr: str) -> list[tuple[int, str, int, int]]:
    """(family, host, socket type, port) of each explicit (non-zero) TCP/UDP port in ``maddr``."""
    parts = maddr.strip("/").split("/")
    family = host = None
    found = []
    for proto, value in zip(parts, parts[1:], strict=False):
        if proto in _FAMILIES:
            family, host = _FAMILIES[proto], value
        elif proto in ("tcp", "udp") and family is not None and value.isdigit() and int(value) != 0:
            found.append((family, host, socket.SOCK_STREAM if proto == "tcp" else socket.SOCK_DGRAM, int(value)))
    return found


def check_ports_free(host_maddrs: Sequence[str]) -> None:
    """Raise :class:`StartupRefused` if a fixed port of ``host_maddrs`` is taken on this machine."""
    for maddr in host_maddrs:
        for family, host, kind, port in _fixed_ports(str(maddr)):
            with socket.socket(family, kind) as probe:
                if kind == socket.SOCK_STREAM:  # a TIME_WAIT leftover of our last run is no conflict
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                try:
                    probe.bind((host, port))
                    if kind == socket.SOCK_STREAM:
                        probe.listen(1)
                except OSError as e:
                    if e.errno == errno.EADDRINUSE:
                        raise StartupRefused(
                            f"--host_maddrs {maddr}: {'TCP' if kind == socket.SOCK_STREAM else 'UDP'} port {port} "
                            f"on {host} is already in use (by another swarm node or another program), so peers "
                            f"given this address would reach that one instead; choose another port, or stop what "
                            f"holds it (`ss -ltnup 'sport = :{port}'` shows it)"
                        ) from None
                    if e.errno == errno.EADDRNOTAVAIL:
                        raise StartupRefused(f"--host_maddrs {maddr}: {host} is not an address of this machine; "
                                             f"listen on one of its addresses, or on 0.0.0.0 for all") from None
                    raise StartupRefused(f"--host_maddrs {maddr}: cannot listen there ({e.strerror}); "
                                         f"choose another address or port") from None


class IdentityClaim:
    """Holds an exclusive lock on an identity file until :meth:`release` (or the process ends)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        self._fd: int | None = None
        if fcntl is None:
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StartupRefused(
                f"identity file {self.path} is already used by another running swarm node on this machine (find it "
                f"with `pgrep -af {self.path.name}`); two nodes with one identity would announce the same peer id. "
                f"Stop that node first, or give this one its own identity: --identity_path NEW_FILE (created if "
                f"missing; in a private swarm the owner must invite its key)"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the file drops the lock
            self._fd = None


async def check_identity_offline(peer_id: str, identity_path: str | Path, initial_peers: Sequence[str], *,
                                 timeout: float = 15.0) -> None:
    """Raise :class:`StartupRefused` if a node with ``peer_id`` is reachable through ``initial_peers``.

    A short-lived anonymous daemon joins the swarm and dials the id; a dial that does not finish in
    ``timeout`` seconds, or a swarm the daemon cannot join, skips the check with a warning (the node starts).
    """
    from hivemind.p2p import P2P, PeerID
    from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

    try:
        probe = await P2P.create(initial_peers=list(initial_peers), dht_mode="client")
    except Exception as e:  # the node's own start reports an unreachable swarm better
        logger.warning("Could not check whether peer id %s is already online (%r); starting anyway", peer_id, e)
        return
    try:
        await asyncio.wait_for(probe._client.connect(PeerID.from_base58(peer_id), []), timeout)
        online = True
    except ControlFailure:  # "routing: not found" or a failed dial: nobody has this id
        online = False
    except asyncio.TimeoutError:
        logger.warning("Could not check in %.0f s whether peer id %s is already online; starting anyway", timeout,
                       peer_id)
        online = False
    finally:
        await probe.shutdown()
    if online:
        raise StartupRefused(
            f"peer id {peer_id} of identity file {identity_path} is already online in the swarm: another node, "
            f"maybe on another machine, runs with this identity (or a copy of it), and two would announce the same "
            f"peer id. Stop that node first, or give this one its own identity: --identity_path NEW_FILE (created "
            f"if missing; in a private swarm the owner must invite its key)"
        )
