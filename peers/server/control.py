"""The operator's control socket of a peer (``--control_socket PATH``): a local unix socket that takes one line per
connection and answers one line.

    move START:END     load blocks START:END while serving the old ones, then switch (``StageServer.move_to``)
    backup             stop serving, free the blocks, announce BACKUP (``StageServer.become_backup``)
    status             what the peer serves now

Only this machine's user reaches it: the socket is created mode 0600 (under a 0177 umask, so never wider even for a
moment) and a connection from another uid (``SO_PEERCRED``) is refused. A line is at most ``MAX_LINE`` bytes and
must arrive within ``READ_TIMEOUT`` s. ``swarm move --control_socket PATH 2:4`` sends one (``send_command``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

logger = logging.getLogger(__name__)

MAX_LINE = 256  # bytes of one command
READ_TIMEOUT = 10.0  # seconds to send the command line
_UCRED = struct.Struct("3i")  # pid, uid, gid


class Movable(Protocol):
    """What the socket drives (``StageServer``)."""

    @property
    def span(self) -> tuple[int, int] | None: ...

    async def move_to(self, start: int, end: int) -> None: ...

    async def become_backup(self) -> None: ...


def parse_command(line: str) -> tuple[str, tuple[int, int] | None]:
    """``"move 2:4"`` / ``"move 2 4"`` -> ("move", (2, 4)); ``"backup"``, ``"status"`` -> (kind, None);
    ``ValueError`` saying what is accepted otherwise."""
    words = line.split()
    usage = "expected `move START:END`, `backup` or `status`"
    if not words:
        raise ValueError(f"empty command; {usage}")
    kind, args = words[0].lower(), words[1:]
    if kind in ("backup", "status") and not args:
        return kind, None
    if kind == "move" and len(args) in (1, 2):
        parts = args[0].split(":") if len(args) == 1 else args
        try:
            start, end = (int(p) for p in parts)
        except ValueError:
            raise ValueError(f"bad span {' '.join(args)[:40]!r}: {usage}") from None
        return kind, (start, end)
    raise ValueError(f"unknown command {line[:40]!r}: {usage}")


def describe(server: Movable) -> str:
    span = server.span
    return f"serving {span[0]}:{span[1]}" if span is not None else "backup (no blocks)"


async def run_command(server: Movable, line: str) -> str:
    """Carry out one command line; the reply line (``ok: ...`` or ``error: ...``)."""
    try:
        kind, span = parse_command(line)
        if kind == "move":
            assert span is not None
            await server.move_to(*span)
        elif kind == "backup":
            await server.become_backup()
    except (ValueError, RuntimeError, OSError) as e:
        return f"error: {e}"
    return f"ok: {describe(server)}"


async def serve_control(path: Path, server: Movable) -> asyncio.AbstractServer:
    """Listen on unix socket ``path`` (mode 0600; a stale socket left by a dead peer is replaced, any other file is
    refused) for ``run_command`` lines."""
    path = Path(path)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise ValueError(f"--control_socket {path} exists and is no socket: pick another path")
        if _answers(path):
            raise ValueError(f"--control_socket {path} is in use by a running peer: pick another path")
        path.unlink()
    handle = _handler(server)
    umask = os.umask(0o177)  # the socket is born 0600
    try:
        listener = await asyncio.start_unix_server(handle, path=str(path), limit=MAX_LINE)
    finally:
        os.umask(umask)
    os.chmod(path, 0o600)
    logger.info("Control socket at %s (`swarm move --control_socket %s START:END`)", path, path)
    return listener


async def close_control(listener: asyncio.AbstractServer, path: Path) -> None:
    listener.close()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(listener.wait_closed(), 5)
    with contextlib.suppress(OSError):
        Path(path).unlink()


def _handler(server: Movable) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if (refusal := _stranger(writer)) is not None:
                logger.warning("Control socket: %s", refusal)
                answer = f"error: {refusal}"
            else:
                try:
                    raw = await asyncio.wait_for(reader.readline(), READ_TIMEOUT)
                    line = raw.decode("utf-8").strip()
                except (asyncio.TimeoutError, ValueError, UnicodeDecodeError, asyncio.LimitOverrunError):
                    answer = f"error: send one line of at most {MAX_LINE} UTF-8 bytes within {READ_TIMEOUT:.0f} s"
                else:
                    logger.info("Control socket: %r", line[:MAX_LINE])
                    answer = await run_command(server, line)
            writer.write((answer + "\n").encode())
            await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    return handle


def _stranger(writer: asyncio.StreamWriter) -> str | None:
    """Why the connecting process may not drive this peer (another uid), or None."""
    sock = writer.get_extra_info("socket")
    try:
        _, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    except (AttributeError, OSError):
        return None  # no SO_PEERCRED here: the socket's 0600 mode is the guard
    if uid != os.getuid():
        return f"refused a connection from uid {uid}: only uid {os.getuid()} may control this peer"
    return None


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def send_command(path: Path, line: str, timeout: float = 600.0) -> str:
    """Send one command line to a peer's control socket and return its answer line (``ok: ...`` / ``error: ...``)."""
    if len(line.encode()) >= MAX_LINE:
        raise ValueError(f"a command has at most {MAX_LINE - 1} bytes")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        sock.sendall(line.strip().encode() + b"\n")
        chunks = []
        while chunk := sock.recv(4096):
            chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace").strip()
