"""Private key files: created atomically with mode 0600, refused when others may read them."""

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
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
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
