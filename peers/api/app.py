"""The aiohttp application of ``swarm api``: routes, the API key, OpenAI-style errors.

Every failure becomes an OpenAI error object with its HTTP status, and the server keeps serving: a bad request
(400: malformed JSON, a wrong parameter, a prompt longer than the context), a wrong model (404), a missing or wrong
API key (401), a swarm that cannot serve right now (503: no peer for some blocks, a peer's refusal), anything else
(500, logged). An error after a stream started is sent as a last ``data: {"error": ...}`` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from peers.api import metrics, sse
from peers.api.engine import ContextError, Engine, Job
from peers.api.errors import ApiError
from peers.api.responses import Reply
from peers.api.schemas import Params, parse_chat, parse_completion
from peers.wire.errors import RequestError
from privacy.errors import MembershipError
from swarm.routing import NoRouteError

logger = logging.getLogger(__name__)
MAX_BODY_BYTES = 8 << 20
SHUTDOWN_S = 5.0  # on SIGINT/SIGTERM, requests in flight get this long to finish
ENGINE: web.AppKey[Engine] = web.AppKey("engine", Engine)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def make_app(engine: Engine, *, api_key: str | None = None) -> web.Application:
    app = web.Application(middlewares=[metrics.count, _errors, _auth(api_key)], client_max_size=MAX_BODY_BYTES)
    app[ENGINE] = engine
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model}", _model)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    return app


async def start(engine: Engine, *, host: str = "127.0.0.1", port: int = 8000,
                api_key: str | None = None) -> tuple[web.AppRunner, str]:
    """Serve on ``host:port`` (0: any free port) from the running loop; the runner (``cleanup()`` it) and the URL."""
    # handler_cancellation: a caller that goes away cancels its request, which closes its session on the peers
    runner = web.AppRunner(make_app(engine, api_key=api_key), access_log=None, shutdown_timeout=SHUTDOWN_S,
                           handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0]
    address = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    return runner, f"http://{address}:{bound[1]}/v1"


# ---- routes --------------------------------------------------------------------------------------
async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_object(request.app[ENGINE])]})


async def _model(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    _check_model(engine, request.match_info["model"])
    return web.json_response(_model_object(engine))


async def _completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    req = parse_completion(await _json(request))
    _check_model(engine, req.params.model)
    prompt_ids = engine.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
    return await _reply(request, engine, _job(engine, prompt_ids, req.params, (), "prompt"), req.params, chat=False)


async def _chat(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    req = parse_chat(await _json(request))
    _check_model(engine, req.params.model)
    prompt_ids, format_stops = engine.chat_prompt([{"role": m.role, "content": m.content} for m in req.messages])
    job = _job(engine, prompt_ids, req.params, format_stops, "messages")
    return await _reply(request, engine, job, req.params, chat=True)


def _model_object(engine: Engine) -> dict[str, Any]:
    return {"id": engine.model_id, "object": "model", "created": 0, "owned_by": "fusionswarm",
            "context_length": engine.context}


def _check_model(engine: Engine, model: str) -> None:
    if model != engine.model_id:
        raise ApiError(404, f"The model `{model}` does not exist: this server serves `{engine.model_id}` "
                            f"(GET /v1/models)", param="model", code="model_not_found")


async def _json(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return json.loads(raw)
    except ValueError as e:
        raise ApiError(400, f"We could not parse the JSON body of your request ({e}): send a JSON object with "
                            "Content-Type: application/json", code="invalid_json") from None


def _job(engine: Engine, prompt_ids: list[int], params: Params, format_stops: tuple[str, ...], what: str) -> Job:
    try:
        return engine.job(prompt_ids, max_tokens=params.max_tokens, temperature=params.temperature,
                          top_p=params.top_p, seed=params.seed, stops=(*params.stop, *format_stops))
    except ContextError as e:
        raise ApiError(400, str(e), param=what, code="context_length_exceeded") from None
    except ValueError as e:
        raise ApiError(400, str(e), param=what, code="invalid_value") from None


# ---- replies -------------------------------------------------------------------------------------
async def _reply(request: web.Request, engine: Engine, job: Job, params: Params, *, chat: bool) -> web.StreamResponse:
    reply, prompt_tokens = Reply(model=engine.model_id, chat=chat), len(job.prompt_ids)
    if not params.stream:
        done = await engine.complete(job)
        metrics.tokens(prompt_tokens, done.completion_tokens)
        return web.json_response(reply.whole(done.text, done.finish_reason, prompt_tokens, done.completion_tokens))
    deltas = engine.stream(job)
    async with contextlib.aclosing(deltas):
        delta = await anext(deltas)  # a failure before the first token still gets its HTTP status
        response = web.StreamResponse(headers={"Content-Type": sse.CONTENT_TYPE, **sse.HEADERS})
        await response.prepare(request)
        metrics.first_token(request)
        usage = params.include_usage
        try:
            if chat:
                await response.write(sse.event(reply.chunk(role=True, with_usage=usage)))
            while True:
                if delta.text:
                    await response.write(sse.event(reply.chunk(delta.text, with_usage=usage)))
                if delta.finish_reason is not None:
                    metrics.tokens(prompt_tokens, delta.completion_tokens)
                    await response.write(sse.event(reply.chunk(finish_reason=delta.finish_reason, with_usage=usage)))
                    if usage:
                        await response.write(sse.event(reply.usage_chunk(prompt_tokens, delta.completion_tokens)))
                    break
                delta = await anext(deltas)
        except (ConnectionError, asyncio.CancelledError):
            raise  # the caller went away: closing the stream ends the session on the peers
        except Exception as e:
            error = as_api_error(e)
            await response.write(sse.event(error.body()))
        await response.write(sse.DONE)
        await response.write_eof()
    return response


# ---- middlewares ---------------------------------------------------------------------------------
def as_api_error(e: BaseException) -> ApiError:
    """The error object and status of an exception raised while serving a request."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, (NoRouteError, RequestError, MembershipError, ConnectionError, TimeoutError)):
        return ApiError(503, f"the swarm could not serve this request: {e} (check `swarm status`; retry later)",
                        type="server_error", code="swarm_unavailable")
    if isinstance(e, ContextError):
        return ApiError(400, str(e), code="context_length_exceeded")
    if isinstance(e, ValueError):
        return ApiError(400, str(e), code="invalid_value")
    logger.error("Request failed: %r", e, exc_info=e)
    return ApiError(500, f"internal error: {e!r}", type="server_error", code="internal_error")


def _error_response(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=error.status)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as e:  # aiohttp's own: unknown route, wrong method, body too large
        if e.status < 400:
            raise
        kind = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status)
        message = f"{e.reason}: {request.method} {request.path}" + (
            " (routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions)" if e.status in (404, 405)
            else f" (at most {MAX_BODY_BYTES} bytes)" if e.status == 413 else "")
        return _error_response(ApiError(e.status, message, code=kind))
    except asyncio.CancelledError:
        raise
    except Exception as e:
        error = as_api_error(e)
        if error.status < 500:
            logger.info("Refused %s %s: %s", request.method, request.path, error.message)
        return _error_response(error)


def _auth(api_key: str | None):
    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if api_key is not None:
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
                given = "no API key" if not token else "an incorrect API key"
                return _error_response(ApiError(
                    401, f"You sent {given}: pass the key given to `swarm api --api_key` as "
                         "`Authorization: Bearer KEY` (the openai client's api_key)", code="invalid_api_key"))
        return await handler(request)

    return check
