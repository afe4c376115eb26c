"""A peer's Prometheus metrics (``--metrics_port``): what it served and refused, how long and how batched, its cache,
sessions and training step, and its bytes per neighbour. Call sites only count (``request_done``, ``batch_done``);
the gauges are read from the server when scraped.

Series stay bounded: request kinds are the wire's message types (a fixed set, plus "unknown" for what did not
parse), and neighbours get a label of their own in the order they are first seen, up to ``MAX_NEIGHBOURS``; the
bytes of every later one are counted under ``neighbour="other"``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from peers.wire import traffic
from peers.wire.messages import InferenceReply

logger = logging.getLogger(__name__)

MAX_NEIGHBOURS = 32
REGISTRY = CollectorRegistry()
REQUESTS = Counter("fusionswarm_requests", "Requests handled, by kind (wire message type)", ["kind"],
                   registry=REGISTRY)
REFUSALS = Counter("fusionswarm_refusals", "Requests refused with an error reply, by kind (stream: refused streams)",
                   ["kind"], registry=REGISTRY)
LATENCY = Histogram("fusionswarm_request_seconds", "Time from a request's arrival to its reply, by kind", ["kind"],
                    buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30), registry=REGISTRY)
BATCH_ROWS = Histogram("fusionswarm_batch_rows", "Rows of each batched computation, by kind (forward | inference)",
                       ["kind"], buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=REGISTRY)
BATCH_REQUESTS = Histogram("fusionswarm_batch_requests", "Requests combined into each batched computation",
                           ["kind"], buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32), registry=REGISTRY)
BYTES = Counter("fusionswarm_bytes", "Stream bytes, by direction (in | out) and neighbour peer id (the first "
                f"{MAX_NEIGHBOURS} seen; later ones: other)", ["direction", "neighbour"], registry=REGISTRY)


class _Neighbours:
    """A label per neighbour for the first ``MAX_NEIGHBOURS`` peer ids, "other" beyond."""

    def __init__(self) -> None:
        self.named: set[str] = set()

    def label(self, peer_id: str) -> str:
        if peer_id in self.named:
            return peer_id
        if peer_id and len(self.named) < MAX_NEIGHBOURS:
            self.named.add(peer_id)
            return peer_id
        return "other"


_neighbours = _Neighbours()


def _count_bytes(direction: str, peer_id: str, nbytes: int) -> None:
    BYTES.labels(direction, _neighbours.label(peer_id)).inc(nbytes)


traffic.listen(_count_bytes)


def request_done(kind: str, responses: Any, started: float) -> None:
    """Count a handled request of ``kind``: replies (a list, or a ``Deferred`` counted when its task ends) whose
    first message carries an error count as a refusal. ``started``: ``time.perf_counter()`` at its arrival."""
    task = getattr(responses, "task", None)
    if isinstance(task, asyncio.Future):
        task.add_done_callback(lambda t: _done(kind, [] if t.cancelled() or t.exception() else t.result(), started))
    else:
        _done(kind, responses, started)


def _done(kind: str, responses: list, started: float) -> None:
    REQUESTS.labels(kind).inc()
    LATENCY.labels(kind).observe(time.perf_counter() - started)
    if responses and _is_error(responses[0]):
        REFUSALS.labels(kind).inc()


def _is_error(response: Any) -> bool:
    try:
        return bool(InferenceReply.from_bytes(response.metadata).error)
    except (ValueError, TypeError):
        return False


def stream_refused() -> None:
    REFUSALS.labels("stream").inc()


def batch_done(kind: str, requests: int, rows: int) -> None:
    BATCH_REQUESTS.labels(kind).observe(requests)
    BATCH_ROWS.labels(kind).observe(rows)


class _ServerState(Collector):
    """Gauges read from the running ``StageServer`` at each scrape: cache tokens, sessions, training step, span."""

    def __init__(self, server: Any) -> None:
        self.server = server

    def collect(self) -> Iterable[GaugeMetricFamily]:
        stage = getattr(self.server, "_stage", None)
        sessions = stage.sessions if stage is not None else None
        cache = GaugeMetricFamily("fusionswarm_cache_tokens", "Inference KV cache tokens, by state (used | free)",
                                  labels=["state"])
        open_ = GaugeMetricFamily("fusionswarm_sessions", "Inference sessions open")
        if sessions is not None:
            cache.add_metric(["used"], sessions.tokens_used)
            cache.add_metric(["free"], sessions.tokens_free)
            open_.add_metric([], len(sessions.sessions))
        else:  # a backup, or not serving yet
            open_.add_metric([], 0)
        yield cache
        yield open_
        training = stage.training if stage is not None else None
        yield GaugeMetricFamily("fusionswarm_training_step", "Training steps applied to the weights served",
                                value=training.step if training is not None else 0)
        span = self.server.span or (0, 0)
        served = GaugeMetricFamily("fusionswarm_blocks", "Blocks served, [start, end) (0, 0: none)",
                                   labels=["bound"])
        served.add_metric(["start"], span[0])
        served.add_metric(["end"], span[1])
        yield served


_lock = threading.Lock()
_serving: set[int] = set()


def serve_metrics(server: Any, port: int, host: str = "127.0.0.1") -> None:
    """Serve ``/metrics`` on ``host:port`` (a thread of prometheus_client's) with ``server``'s gauges."""
    with _lock:
        if port in _serving:
            return
        REGISTRY.register(_ServerState(server))
        try:
            start_http_server(port, addr=host, registry=REGISTRY)
        except OSError as e:
            raise ValueError(f"--metrics_port {port}: cannot listen on {host}:{port} ({e}); pick a free port") from e
        _serving.add(port)
    logger.info("Prometheus metrics at http://%s:%d/metrics", host, port)
