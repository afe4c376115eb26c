"""``swarm api``'s Prometheus metrics (``--metrics_port``): requests by route and status, how long they took and
how long to the first token, tokens in and out, requests in flight.

Series stay bounded: a route label is one of the API's routes (an unknown path counts as "other"), a status one of
the HTTP statuses the API answers with.
"""

from __future__ import annotations

import time

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

ROUTES = ("/v1/models", "/v1/models/{model}", "/v1/completions", "/v1/chat/completions")
REGISTRY = CollectorRegistry()
REQUESTS = Counter("fusionswarm_api_requests", "HTTP requests answered, by route and status", ["route", "status"],
                   registry=REGISTRY)
SECONDS = Histogram("fusionswarm_api_request_seconds", "Time from a request's arrival to its reply's end, by route",
                    ["route"], buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120), registry=REGISTRY)
FIRST_TOKEN = Histogram("fusionswarm_api_first_token_seconds", "Time from a streamed request's arrival to its first "
                        "text", buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10), registry=REGISTRY)
TOKENS = Counter("fusionswarm_api_tokens", "Tokens of prompts (prompt) and generated (completion)", ["kind"],
                 registry=REGISTRY)
IN_FLIGHT = Gauge("fusionswarm_api_requests_in_flight", "Requests being answered now", registry=REGISTRY)
ARRIVED: web.RequestKey[float] = web.RequestKey("arrived", float)


def serve(port: int, host: str = "127.0.0.1") -> int:
    """Serve ``/metrics`` on ``host:port`` (0: any free port) in a thread; returns the port."""
    try:
        server, _ = start_http_server(port, addr=host, registry=REGISTRY)
    except OSError as e:
        raise ValueError(f"--metrics_port {port}: cannot listen on {host}:{port} ({e}); pick a free port") from e
    return int(server.server_address[1])


def route_of(request: web.Request) -> str:
    resource = request.match_info.route.resource
    canonical = resource.canonical if resource is not None else ""
    return canonical if canonical in ROUTES else "other"


def tokens(prompt: int, completion: int) -> None:
    TOKENS.labels("prompt").inc(prompt)
    TOKENS.labels("completion").inc(completion)


def first_token(request: web.Request) -> None:
    """The request's first text is about to go out."""
    FIRST_TOKEN.observe(time.perf_counter() - request.get(ARRIVED, time.perf_counter()))


@web.middleware
async def count(request: web.Request, handler) -> web.StreamResponse:
    """Outermost middleware: every answer counts, errors included (a caller that went away counts as 499)."""
    request[ARRIVED] = started = time.perf_counter()
    status = 499
    IN_FLIGHT.inc()
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as e:
        status = e.status
        raise
    finally:
        IN_FLIGHT.dec()
        route = route_of(request)
        REQUESTS.labels(route, str(status)).inc()
        SECONDS.labels(route).observe(time.perf_counter() - started)
