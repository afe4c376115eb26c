"""Compute of one block on this peer's device (throughput; forward and backward seconds per token), measured once
and cached on disk."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
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
    cache = _read_cache(path)
    value = cache.get(key)
    if isinstance(value, (int, float)) and value > 0:
        return float(value)
    value = float(measure())
    cache[key] = value
    _write_cache(path, cache)
    return value


@dataclass(frozen=True)
class Compute:
    """Measured compute of one block on this device: seconds per token, forward and backward."""

    forward: float
    backward: float

    def __post_init__(self) -> None:
        for name in ("forward", "backward"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} compute must be a positive number of seconds, got {value!r}")


def cached_compute(cache_dir: Path, key: str, measure: Callable[[], Compute]) -> Compute:
    """The forward/backward compute cached under ``compute:KEY`` in ``cache_dir/throughput.json`` (the same file
    as the throughput), measuring it if absent or invalid."""
    path = Path(cache_dir) / "throughput.json"
    cache = _read_cache(path)
    entry = cache.get(f"compute:{key}")
    if isinstance(entry, dict):
        try:
            return Compute(entry.get("forward"), entry.get("backward"))  # type: ignore[arg-type]
        except ValueError:
            pass
    value = measure()
    store_compute(cache_dir, key, value)
    return value


def store_compute(cache_dir: Path, key: str, value: Compute) -> None:
    """Cache ``value`` under ``compute:KEY`` (what ``cached_compute`` reads next time)."""
    path = Path(cache_dir) / "throughput.json"
    cache = _read_cache(path)
    cache[f"compute:{key}"] = {"forward": value.forward, "backward": value.backward}
    _write_cache(path, cache)


def _read_cache(path: Path) -> dict:
    try:
        cache = json.loads(path.read_text())
        if not isinstance(cache, dict):
            raise ValueError("not a dict")
    except FileNotFoundError:
        cache = {}
    except (OSError, ValueError) as e:
        logger.warning("Ignoring unreadable throughput cache %s (%s); it will be rewritten", path, e)
        cache = {}
    return cache


def _write_cache(path: Path, cache: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
    tmp.replace(path)
