"""`create_app(config)`: the Starlette app, its lifespan, and the one error → status mapping."""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from clipserve import errors
from clipserve.config import ServerConfig
from clipserve.http.doors import kserve as kserve_api
from clipserve.http.doors import native as routes
from clipserve.http.doors import openai as openai_api
from clipserve.http.pipeline import ClientGone, Pipeline, Serving, Tower
from clipserve.inference.runtime import Runtime, build_runtime
from clipserve.inference.towers import Towers, add_status_gauges
from clipserve.metrics import Metrics
from clipserve.protocol.responses import encode_error

log = logging.getLogger(__name__)

STATUS: dict[type[errors.ClipserveError], int] = {
    errors.InvalidImage: 400,
    errors.InvalidTensor: 400,
    errors.InvalidBody: 400,
    errors.InvalidText: 400,
    errors.TextTooLong: 413,
    errors.TooManyTexts: 413,
    errors.PayloadTooLarge: 413,
    errors.ImageTooLarge: 413,
    errors.TooManyItems: 413,
    errors.UnsupportedMediaType: 415,
    errors.NotAcceptable: 406,
    errors.InvalidParameter: 422,
    errors.ModelNotFound: 404,
    errors.Overloaded: 503,
    errors.NotReady: 503,
    errors.InvalidHeader: 400,
    errors.RequestTimeout: 504,
    errors.ExecutorFailed: 500,
    errors.NonFiniteEmbedding: 422,
}
CLIENT_CLOSED = 499  # nginx's code for "client closed request"; nobody reads the body
MAX_REQUEST_ID = 128
ENGINE_CONNECT_TIMEOUT_S = 60.0


def status_for(error: errors.ClipserveError) -> int:
    for cls in type(error).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500


ErrorRenderer = Callable[[int, str, str], Response]  # (status, code, message) → response


def native_error(status: int, code: str, message: str) -> Response:
    return Response(encode_error(code, message), status, media_type="application/json")


# Route families that answer errors in their own ecosystem's shape, by path prefix; every other
# path answers clipserve's {"error": {"code", "message"}}.
ERROR_STYLES: tuple[tuple[str, ErrorRenderer], ...] = (
    ("/v1/", openai_api.render_error),
    ("/v2", kserve_api.render_error),
)


def error_response(path: str, status: int, code: str, message: str) -> Response:
    for prefix, render in ERROR_STYLES:
        if path.startswith(prefix):
            return render(status, code, message)
    return native_error(status, code, message)


async def _domain_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, errors.ClipserveError)
    status = status_for(exc)
    message = "internal error" if status == 500 else exc.message  # 500s stay opaque
    response = error_response(request.url.path, status, exc.code, message)
    timer = getattr(request.state, "timer", None)
    if timer is not None and timer.stages:
        response.headers["Server-Timing"] = timer.header()
    retry_after = getattr(exc, "retry_after_s", None)
    if retry_after is not None:
        response.headers["Retry-After"] = str(retry_after)
    return response


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405 (no route, wrong method) in the same JSON shape as the rest."""
    assert isinstance(exc, HTTPException)
    code = _HTTP_CODES.get(exc.status_code, "http_error")
    message = f"{request.method} {request.url.path[:200]}: {exc.detail}"
    response = error_response(request.url.path, exc.status_code, code, message)
    response.headers.update(exc.headers or {})  # 405 carries Allow
    return response


async def _client_gone(request: Request, exc: Exception) -> Response:
    return native_error(CLIENT_CLOSED, "client_closed", "client closed the request")


# Request ids made here: a random prefix per process and a counter. uuid4 read os.urandom per
# request, 7% of the event loop's time on small requests (bench/frontend.py's profile).
_ID_PREFIX = secrets.token_hex(6)
_ID_COUNTER = itertools.count()


def _new_request_id() -> str:
    return f"{_ID_PREFIX}{next(_ID_COUNTER):08x}"


def _valid_request_id(raw: bytes) -> bool:
    """Visible ASCII only: it is echoed in a header and written to logs as it came."""
    return 0 < len(raw) <= MAX_REQUEST_ID and all(0x21 <= b <= 0x7E for b in raw)


class RequestObserver:
    """The outermost layer of every request: assigns or checks the request id, adds
    `X-Request-Id` and `Server-Timing` (with the total) to every answer, counts every response by
    route and status, and answers 503 `shutting_down` to requests the drain timeout cancels."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        sent_id = dict(scope["headers"]).get(b"x-request-id")
        valid_id = sent_id is None or _valid_request_id(sent_id)
        request_id = sent_id.decode("ascii") if sent_id and valid_id else _new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        status, started = 500, False

        async def send_wrapper(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
                total = f"total;dur={(time.perf_counter() - t0) * 1000:.3f}"
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"server-timing"]
                timing = [v for k, v in message.get("headers", []) if k == b"server-timing"]
                stages = b", ".join([*timing, total.encode()])
                message["headers"] = [
                    *headers, (b"x-request-id", request_id.encode()), (b"server-timing", stages)
                ]  # fmt: skip
            await send(message)

        async def answer(status: int, code: str, message: str, retry_after: int | None) -> None:
            response = error_response(scope["path"], status, code, message)
            if retry_after is not None:
                response.headers["Retry-After"] = str(retry_after)
            await response(scope, receive, send_wrapper)

        try:
            if not valid_id:
                await answer(400, errors.InvalidHeader.code,
                             f"X-Request-Id must be 1 to {MAX_REQUEST_ID} visible ASCII "
                             "characters", None)  # fmt: skip
                return
            await self.app(scope, receive, send_wrapper)
        except Exception as exc:  # not a domain error: opaque 500, logged once with its id
            log.error("unhandled error, request id %s", request_id, exc_info=exc)
            if started:
                raise
            await answer(500, "internal", "internal error", None)
        except asyncio.CancelledError:
            # uvicorn cancels what is still running when --drain-timeout-s expires.
            if started:
                raise
            log.warning("request %s cancelled: drain timeout expired", request_id)
            await answer(503, errors.ShuttingDown.code,
                         "server is shutting down; retry on another replica",
                         errors.ShuttingDown.retry_after_s)  # fmt: skip
        finally:
            # The matched route's template (one label for /v2/models/{name}/infer), else other.
            route = getattr(scope.get("route"), "path", "other")
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.request_duration.labels(route).observe(time.perf_counter() - t0)


@asynccontextmanager
async def _towers(
    config: ServerConfig,
    runtime: Runtime | None,
    engine: tuple[str, dict[str, Any]] | None,
    metrics: Metrics,
) -> AsyncIterator[tuple[Serving, Tower, Tower]]:
    """The image and text towers: Batchers in this process, or the engine's (`--workers N`)."""
    if engine is not None:
        from clipserve.engine.remote import EngineLink, FrontRuntime, RemoteTower

        socket_path, card = engine
        link = EngineLink(socket_path, config, card)
        try:
            await link.start(ENGINE_CONNECT_TIMEOUT_S)
            front = await asyncio.to_thread(
                FrontRuntime.from_card, card, config, link.arena.slot_bytes
            )
            add_status_gauges(metrics, link.snapshot)
            yield front, RemoteTower(link, "image"), RemoteTower(link, "text")
        finally:
            await link.close()
        return
    rt = runtime if runtime is not None else await asyncio.to_thread(build_runtime, config)
    try:
        towers = Towers.build(rt, metrics)
        add_status_gauges(metrics, towers.status)
        towers.start()
        try:
            yield rt, towers.image, towers.text
        finally:
            await towers.stop()
    finally:
        rt.close()


def create_app(
    config: ServerConfig,
    runtime: Runtime | None = None,
    registry: CollectorRegistry | None = None,
    engine: tuple[str, dict[str, Any]] | None = None,
) -> Starlette:
    """The ASGI app. Without a prebuilt `runtime`, the lifespan loads the model and warms up;
    with `engine` (its socket and model card), a front end of the engine process instead.

    The lifespan owns everything it starts: towers → decode pool, torn down in reverse; the
    runtime's executors are closed on shutdown either way.
    """
    metrics = Metrics(registry)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Pipeline]]:
        async with _towers(config, runtime, engine, metrics) as (rt, image, text):
            pool = ThreadPoolExecutor(
                rt.decode_workers(config.limits.decode_workers),
                thread_name_prefix="clipserve-decode",
            )
            # The config as served: batch and queue sizes resolved for the devices.
            app.state.server = Pipeline(rt.config, rt, image, text, metrics, pool)
            log.info("serving %s with %s on %s", rt.model.identity, rt.backend,
                     ", ".join(rt.devices))  # fmt: skip
            # What startup built (the model, torch: ~400k objects) lives as long as the server.
            # Out of the collector's sight, full collections under load stop stalling the loop
            # 0.3-0.8 s (bench/goodput.py: p99 of 503s 830 -> 15 ms).
            gc.freeze()
            try:
                yield {"server": app.state.server}
            finally:
                gc.unfreeze()
                pool.shutdown(wait=True)

    app = Starlette(
        routes=[
            Route("/embed", routes.embed, methods=["POST"]),
            Route("/embed/text", routes.embed_text, methods=["POST"]),
            Route("/info", routes.info, methods=["GET"]),
            Route("/healthz", routes.healthz, methods=["GET"]),
            Route("/readyz", routes.readyz, methods=["GET"]),
            Route("/metrics", routes.metrics, methods=["GET"]),
            # Other ecosystems' protocols: their own routes, through the same pipeline.
            *openai_api.ROUTES,
            *kserve_api.ROUTES,
        ],
        exception_handlers={
            errors.ClipserveError: _domain_error,
            HTTPException: _http_error,
            ClientGone: _client_gone,
            ClientDisconnect: _client_gone,
        },
        lifespan=lifespan,
    )
    app.add_middleware(RequestObserver, metrics=metrics)
    return app
