"""The built-in training text: docstrings of the Python standard library, made locally (nothing downloaded).

``builtin_corpus()`` parses (never imports) a fixed list of about 100 prose-rich stdlib modules
(``CORPUS_MODULES``) and concatenates their module, class and function docstrings in order: about
1.1 MB of English technical prose. The text is the same for a given Python version and is written
once to a cache file named after that version.
"""

from __future__ import annotations

import ast
import logging
import os
import sys
import sysconfig
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

# Prose-rich stdlib modules (paths under the stdlib folder), sorted; ones missing in this Python are skipped.
CORPUS_MODULES: tuple[str, ...] = (
    "_collections_abc.py", "_pydecimal.py", "_pyio.py", "aifc.py", "argparse.py", "ast.py",
    "asyncio/base_events.py", "asyncio/events.py", "asyncio/locks.py", "asyncio/protocols.py",
    "asyncio/streams.py", "asyncio/tasks.py", "asyncio/transports.py", "base64.py", "bdb.py", "bz2.py",
    "cgi.py", "cmd.py", "code.py", "codecs.py", "collections/__init__.py", "concurrent/futures/_base.py",
    "concurrent/futures/process.py", "configparser.py", "contextlib.py", "difflib.py", "dis.py",
    "doctest.py", "email/_header_value_parser.py", "email/_policybase.py", "email/charset.py",
    "email/header.py", "email/headerregistry.py", "email/message.py", "email/policy.py", "enum.py",
    "fileinput.py", "fractions.py", "ftplib.py", "functools.py", "http/client.py", "http/cookiejar.py",
    "http/cookies.py", "http/server.py", "imaplib.py", "importlib/_bootstrap.py",
    "importlib/_bootstrap_external.py", "importlib/abc.py", "importlib/metadata/__init__.py", "inspect.py",
    "ipaddress.py", "json/__init__.py", "logging/__init__.py", "logging/handlers.py", "lzma.py", "mailbox.py",
    "mimetypes.py", "nntplib.py", "optparse.py", "os.py", "pathlib.py", "pdb.py", "pkgutil.py", "platform.py",
    "poplib.py", "queue.py", "random.py", "re/__init__.py", "shutil.py", "site.py", "smtplib.py", "socket.py",
    "socketserver.py", "ssl.py", "statistics.py", "subprocess.py", "sunau.py", "tarfile.py", "telnetlib.py",
    "tempfile.py", "textwrap.py", "threading.py", "timeit.py", "traceback.py", "turtle.py", "typing.py",
    "unittest/case.py", "unittest/mock.py", "urllib/parse.py", "urllib/request.py", "uuid.py", "wave.py",
    "wsgiref/handlers.py", "xml/etree/ElementTree.py", "xml/sax/handler.py", "xml/sax/xmlreader.py",
    "xmlrpc/client.py", "xmlrpc/server.py", "zipfile.py",
)
_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_BODIES = ("body", "orelse", "finalbody", "handlers", "cases")


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/fusionswarm`` (``~/.cache/fusionswarm`` by default)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fusionswarm"


def stdlib_sources(root: Path | None = None) -> list[Path]:
    """The ``CORPUS_MODULES`` files present in this Python's stdlib, in list order."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    return [root / rel for rel in CORPUS_MODULES if (root / rel).is_file()]


def docstrings_of(source: str) -> list[str]:
    """Module, class and function docstrings of one Python source, in file order."""
    docs: list[str] = []
    todo: list[ast.AST] = [ast.parse(source)]
    while todo:  # statements only: docstrings never hide inside expressions
        node = todo.pop()
        if isinstance(node, _DOC_NODES):
            doc = ast.get_docstring(node)
            if doc:
                docs.append(doc)
        for name in _BODIES:
            todo.extend(reversed(getattr(node, name, None) or ()))
    return docs


def build_corpus_text(root: Path | None = None) -> str:
    """Concatenate the docstrings of ``stdlib_sources(root)``, separated by blank lines."""
    parts = []
    for path in stdlib_sources(root):
        try:
            parts.extend(docstrings_of(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError) as e:
            logger.debug("corpus: skipping %s (%s)", path, e)
    return "\n\n".join(parts) + "\n"


def builtin_corpus(cache_dir: str | Path | None = None) -> Path:
    """Path of the cached built-in corpus, building it on first use (a few seconds)."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    impl, (major, minor) = sys.implementation.name, sys.version_info[:2]
    path = cache_dir / f"stdlib-docstrings-{impl}{major}.{minor}.txt"
    if path.is_file():
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    text = build_corpus_text()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=cache_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    logger.info("built the stdlib docstring corpus: %d characters at %s", len(text), path)
    return path


def read_corpus(path: str | Path | None = None, *, cache_dir: str | Path | None = None) -> str:
    """Text of a UTF-8 file, or of the built-in corpus when ``path`` is None."""
    path = builtin_corpus(cache_dir) if path is None else Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise ValueError(f"training data {path} does not exist: give a UTF-8 text file, or none for the "
                         "built-in corpus") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"training data {path} is not UTF-8 text: {e}") from e
