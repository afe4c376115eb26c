"""A real headless Chromium (Debian's ``chromium``) driven over the DevTools protocol with aiohttp's websocket
client: open a page, evaluate JavaScript in it, take a screenshot. The page stays open in real time, so its own
scripts (the monitor's refresh) run as they would for a person looking at it."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "chrome")


def chromium_binary() -> str | None:
    return next((path for name in CANDIDATES if (path := shutil.which(name))), None)


class Chromium:
    """``async with Chromium(workdir) as browser: page = await browser.open(url)``."""

    def __init__(self, workdir: Path, size: tuple[int, int] = (1280, 900)) -> None:
        binary = chromium_binary()
        if binary is None:
            raise RuntimeError("no chromium binary")
        self.profile = Path(workdir) / "chromium-profile"
        self.profile.mkdir(parents=True, exist_ok=True)
        self.log = open(Path(workdir) / "chromium.log", "wb")  # noqa: SIM115 - closed in __aexit__
        self.proc = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             f"--user-data-dir={self.profile}", "--remote-debugging-port=0", f"--window-size={size[0]},{size[1]}",
             "about:blank"], stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Chromium:
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not port_file.is_file() or not port_file.read_text().strip():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start (see {self.log.name})")
            await asyncio.sleep(0.1)
        self.port = int(port_file.read_text().split()[0])
        self.session = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc) -> None:
        if self.session is not None:
            await self.session.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.log.close()

    async def open(self, url: str) -> Page:
        assert self.session is not None
        async with self.session.put(f"http://127.0.0.1:{self.port}/json/new?{url}") as reply:
            target = await reply.json(content_type=None)
        ws = await self.session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0)
        page = Page(ws)
        await page.wait_for(f"location.href === {json.dumps(url)} && document.readyState === 'complete'", timeout=30)
        return page


class Page:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws, self._ids = ws, itertools.count(1)

    async def call(self, method: str, **params) -> dict[str, Any]:
        call_id = next(self._ids)
        await self.ws.send_str(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads((await self.ws.receive(timeout=30)).data)
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float) -> float:
        """Seconds until ``expression`` is true in the page; ``TimeoutError`` after ``timeout``."""
        started = time.monotonic()
        while not await self.evaluate(expression):
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"{expression!r} still false after {timeout:.0f} s")
            await asyncio.sleep(0.2)
        return time.monotonic() - started

    async def screenshot(self, path: Path) -> None:
        data = (await self.call("Page.captureScreenshot", format="png"))["data"]
        Path(path).write_bytes(base64.b64decode(data))
