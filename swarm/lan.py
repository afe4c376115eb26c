"""Zero-configuration discovery on a LAN (mDNS, ``zeroconf``): nodes started with no initial peers advertise their
multiaddrs as a ``_fusionswarm._tcp.local.`` service on the local link, and find each other's there.

Announcements stay on the local link (multicast 224.0.0.251, never routed) and on the interfaces of the node's
``--host_maddrs``: a node that listens on 127.0.0.1 only (the default) is seen by this machine only; one on
0.0.0.0, by the LAN. A service carries a node's peer id (its instance name) and multiaddrs (TXT ``m0``, ``m1``,
...), which a public swarm's DHT shows anyone anyway. A private swarm's nodes neither advertise nor browse (its
records are sealed for members; its addresses are not put on the LAN): they join with ``--initial_peers``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence

from zeroconf import InterfaceChoice, IPVersion, ServiceInfo, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncZeroconf

logger = logging.getLogger(__name__)

SERVICE = "_fusionswarm._tcp.local."
FIND_WAIT = 3.0  # seconds a node with no initial peers listens for others before it starts a swarm of its own
FIRST_GRACE = 0.5  # after the first answer, seconds to hear the others too
INFO_TIMEOUT_MS = 3000
MAX_TXT = 250  # bytes of one TXT string (the format's limit is 255)

Found = Callable[[str, list[str]], Awaitable[None]]  # (peer id, its multiaddrs)


def interfaces(host_maddrs: Sequence[str]) -> list[str] | InterfaceChoice:
    """The IPv4 addresses mDNS uses: those of ``host_maddrs`` (any of them 0.0.0.0: every interface)."""
    addresses = [m.split("/")[2] for m in host_maddrs if m.startswith("/ip4/")]
    if not addresses or "0.0.0.0" in addresses:
        return InterfaceChoice.All
    return sorted(set(addresses))


def _txt(maddrs: Sequence[str]) -> dict[str, str]:
    return {f"m{i}": m for i, m in enumerate(m for m in maddrs if len(m.encode()) <= MAX_TXT)}


def _maddrs(info: ServiceInfo) -> list[str]:
    out = []
    for key, value in sorted((info.properties or {}).items()):
        if key.startswith(b"m") and value:
            try:
                maddr = value.decode()
            except UnicodeDecodeError:
                continue
            if maddr.startswith("/") and "/p2p/" in maddr:
                out.append(maddr)
    return out


class LanBrowser:
    """Listens for advertised nodes and awaits ``found(peer_id, maddrs)`` for each new one (not ``skip``)."""

    def __init__(self, host_maddrs: Sequence[str], found: Found, skip: str = "") -> None:
        self.zeroconf = AsyncZeroconf(interfaces=interfaces(host_maddrs), ip_version=IPVersion.V4Only)
        self.found, self.skip = found, skip
        self.seen: set[str] = set()
        self._tasks: set[asyncio.Task] = set()
        self._browser = AsyncServiceBrowser(self.zeroconf.zeroconf, SERVICE, handlers=[self._changed])

    def _changed(self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change is ServiceStateChange.Removed:
            self.seen.discard(name)
        elif name not in self.seen:
            self.seen.add(name)
            task = asyncio.ensure_future(self._resolve(name))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _resolve(self, name: str) -> None:
        peer_id = name.removesuffix("." + SERVICE)
        if peer_id == self.skip:
            return
        info = await self.zeroconf.async_get_service_info(SERVICE, name, INFO_TIMEOUT_MS)
        maddrs = _maddrs(info) if info is not None else []
        if maddrs:
            try:
                await self.found(peer_id, maddrs)
            except Exception as e:  # one bad answer must not stop the browser
                logger.debug("LAN node %s: %r", peer_id, e)

    async def close(self) -> None:
        await self._browser.async_cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.zeroconf.async_close()


async def find_swarm(host_maddrs: Sequence[str], wait: float = FIND_WAIT) -> list[str]:
    """Multiaddrs of the nodes advertised on the LAN: waits up to ``wait`` seconds for the first, then
    ``FIRST_GRACE`` for others; empty if none answered."""
    maddrs: dict[str, list[str]] = {}
    first = asyncio.Event()

    async def found(peer_id: str, addrs: list[str]) -> None:
        maddrs[peer_id] = addrs
        first.set()

    browser = LanBrowser(host_maddrs, found)
    try:
        try:
            await asyncio.wait_for(first.wait(), wait)
            await asyncio.sleep(FIRST_GRACE)
        except asyncio.TimeoutError:
            pass
    finally:
        await browser.close()
    return [m for addrs in maddrs.values() for m in addrs]


class LanPresence:
    """This node on the LAN: its service advertised, and a browser that hands ``found`` every other node seen later
    (two nodes that started swarms of their own at the same time join them through it)."""

    def __init__(self, peer_id: str, maddrs: Sequence[str], host_maddrs: Sequence[str], found: Found) -> None:
        self.peer_id, self.maddrs, self.host_maddrs, self.found = peer_id, list(maddrs), list(host_maddrs), found
        self.advertiser: AsyncZeroconf | None = None
        self.browser: LanBrowser | None = None

    async def start(self) -> LanPresence:
        ips = sorted({m.split("/")[2] for m in self.maddrs if m.startswith("/ip4/")})
        port = next((int(m.split("/")[4]) for m in self.maddrs if m.startswith("/ip4/") and "/tcp/" in m), 0)
        info = ServiceInfo(SERVICE, f"{self.peer_id}.{SERVICE}", port=port, properties=_txt(self.maddrs),
                           addresses=[socket.inet_aton(ip) for ip in ips], server=f"{self.peer_id[-16:]}.local.")
        self.advertiser = AsyncZeroconf(interfaces=interfaces(self.host_maddrs), ip_version=IPVersion.V4Only)
        await self.advertiser.async_register_service(info, allow_name_change=True)
        self.browser = LanBrowser(self.host_maddrs, self.found, skip=self.peer_id)
        logger.info("Advertised on the LAN (mDNS %s): %s", SERVICE, " ".join(self.maddrs))
        return self

    async def close(self) -> None:
        if self.browser is not None:
            await self.browser.close()
        if self.advertiser is not None:
            await self.advertiser.async_unregister_all_services()
            await self.advertiser.async_close()
