"""The monitor's web server: an aiohttp app on the event loop of its DHT node (no threads), which re-reads the swarm
every ``refresh`` seconds and serves the last reading: ``/`` (the page), ``/fragment`` (what the page's script swaps
in) and ``/api/state`` (the same data as JSON)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from aiohttp import web
from hivemind.dht.node import DHTNode

from peers.monitor.page import fragment, page
from peers.monitor.snapshot import OnlineSince, model_view, swarm_state
from swarm.discovery import fetch_swarm

logger = logging.getLogger(__name__)


class Monitor:
    """Reads ``models`` (name, number of blocks; 0: unknown) through ``node`` every ``refresh`` seconds."""

    def __init__(self, node: DHTNode, models: Sequence[tuple[str, int]], *, refresh: float, private: bool,
                 dht_timeout: float = 10.0) -> None:
        if refresh <= 0:
            raise ValueError(f"--refresh must be positive, got {refresh}")
        self.node, self.models, self.refresh, self.private = node, list(models), refresh, private
        self.dht_timeout = min(dht_timeout, max(refresh, 1.0) * 3)
        self._since = {name: OnlineSince() for name, _ in self.models}
        self.state: dict[str, Any] = swarm_state(
            [model_view(name, [], [], blocks, since={}, error="not read yet") for name, blocks in self.models],
            private=private, refresh=refresh)

    async def read(self) -> dict[str, Any]:
        """One reading of every model; a lookup that fails is shown as the model's error, never raised."""
        views = []
        for name, blocks in self.models:
            try:
                records, plans = await fetch_swarm(self.node, name, self.dht_timeout)
                since = self._since[name].update(records, time.time())
                views.append(model_view(name, records, plans, blocks, since=since, sealed=records.sealed))
            except Exception as e:  # the page says what failed and keeps refreshing
                logger.warning("Could not read %s from the DHT: %r", name, e)
                views.append(model_view(name, [], [], blocks, since={}, error=f"DHT lookup failed: {e!r}"))
        self.state = swarm_state(views, private=self.private, refresh=self.refresh)
        return self.state

    async def keep_reading(self) -> None:
        while True:
            started = asyncio.get_running_loop().time()
            await self.read()
            await asyncio.sleep(max(0.0, self.refresh - (asyncio.get_running_loop().time() - started)))

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/", self._page)
        app.router.add_get("/fragment", self._fragment)
        app.router.add_get("/api/state", self._json)
        return app

    async def _page(self, request: web.Request) -> web.Response:
        return web.Response(text=page(self.state), content_type="text/html", headers=_NO_CACHE)

    async def _fragment(self, request: web.Request) -> web.Response:
        return web.Response(text=fragment(self.state), content_type="text/html", headers=_NO_CACHE)

    async def _json(self, request: web.Request) -> web.Response:
        return web.json_response(self.state, headers=_NO_CACHE)


_NO_CACHE = {"Cache-Control": "no-store"}


async def serve_monitor(monitor: Monitor, host: str, port: int, stop: asyncio.Event) -> None:
    """Read once, serve on ``host:port`` (0: any free port; the URL is logged) until ``stop`` is set."""
    await monitor.read()
    runner = web.AppRunner(monitor.app(), access_log=None)
    await runner.setup()
    reading = None
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1] if site._server and site._server.sockets else port
        print(f"Monitor at http://{host}:{bound}/ (JSON: http://{host}:{bound}/api/state)", flush=True)
        reading = asyncio.create_task(monitor.keep_reading())
        await stop.wait()
    finally:
        if reading is not None:
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
        await runner.cleanup()
