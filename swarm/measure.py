"""Compute throughput of one block on this peer's device, measured once and cached on disk."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)


def time_per_call(fn: Callable[[], object], *, warmup: int = 1, repeats: int = 5) -> float:
    """Median wall time of ``fn()`` in seconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def cached_throughput(cache_dir: Path, key: str, measure: Callable[[], float]) -> float:
    """Return the throughput cached under ``key`` in ``cache_dir/throughput.json``, measuring it if absent."""
    path = Path(cache_dir) / "throughput.json"
    try:
        cache = json.loads(path.read_text())
        if not isinstance(cache, dict):
            raise ValueError("not a dict")
    except FileNotFoundError:
        cache = {}
    except (OSError, ValueError) as e:
        logger.warning("Ignoring unreadable throughput cache %s (%s); it will be rewritten", path, e)
        cache = {}
    value = cache.get(key)
    if isinstance(value, (int, float)) and value > 0:
        return float(value)
    value = float(measure())
    cache[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
    tmp.replace(path)
    return value
