"""Secret files (keys, credentials, the owner's ledger and revocations): always mode 0600, from creation on.

``write_private`` creates a complete file atomically, ``append_private`` appends to one; both create it with
mode 0600 (never a moment world-readable), and an existing file that others may read is made 0600 first,
with a warning. ``read_private`` refuses a key file that others may read.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

from privacy.errors import PrivacyError

logger = logging.getLogger(__name__)


def write_private(path: str | Path, data: bytes, *, what: str, overwrite: bool = False) -> Path:
    """Write ``data`` to ``path`` with mode 0600; the file appears complete or not at all.

    Without ``overwrite`` an existing file is never replaced (raises ``FileExistsError``).
    """
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            if hasattr(os, "fchmod"):
                os.fchmod(fd, 0o600)
            _write_all(fd, data)
        finally:
            os.close(fd)
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # atomic and never replaces an existing file
            except FileExistsError:
                raise FileExistsError(
                    f"{what} file {path} already exists; refusing to overwrite it (move it away first)"
                ) from None
            except OSError:  # file systems without hard links
                if path.exists():
                    raise FileExistsError(
                        f"{what} file {path} already exists; refusing to overwrite it (move it away first)"
                    ) from None
                os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    logger.debug("wrote %s file %s (mode 0600)", what, path)
    return path


def append_private(path: str | Path, data: bytes, *, what: str) -> Path:
    """Append ``data`` to ``path``, creating it with mode 0600; an existing file others may read is made 0600."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        _tighten(fd, path, what)
        _write_all(fd, data)
    finally:
        os.close(fd)
    return path


def secure_existing(path: str | Path, *, what: str) -> None:
    """Make an existing secret file 0600 if group or others may read or write it (with a warning)."""
    path = Path(path).expanduser()
    fd = os.open(path, os.O_RDONLY)
    try:
        _tighten(fd, path, what)
    finally:
        os.close(fd)


def _tighten(fd: int, path: Path, what: str) -> None:
    if os.name == "nt" or not hasattr(os, "fchmod"):
        return
    mode = stat.S_IMODE(os.fstat(fd).st_mode)
    if not mode & 0o077:
        return
    try:
        os.fchmod(fd, 0o600)
    except PermissionError:
        raise PrivacyError(f"{what} file {path} has mode {mode:04o} (other users may read it) and is not ours to "
                           f"change; ask its owner to run `chmod 600 {path}`, or use a file of your own") from None
    logger.warning("%s file %s had mode %04o: other users of this machine could read it; it is now 0600 "
                   "(if someone may have read it, treat what it holds as known to them)", what, path, mode)


def read_private(path: str | Path, *, what: str) -> bytes:
    """Read a secret file, refusing it if group or others may read or write it."""
    path = Path(path).expanduser()
    st = path.stat()
    if os.name != "nt" and st.st_mode & 0o077:
        mode = stat.S_IMODE(st.st_mode)
        raise PrivacyError(
            f"{what} file {path} has mode {mode:04o}: other users may read the secret in it; "
            f"run `chmod 600 {path}` if it was not exposed, otherwise create a new one"
        )
    return path.read_bytes()


def _write_all(fd: int, data: bytes) -> None:
    """All of ``data`` to ``fd``, then to disk."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.fsync(fd)
