"""`create_app(config)`: the Starlette app, its lifespan, and the one error → status mapping."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from clipserve import errors, routes
from clipserve.batching import Batcher
from clipserve.config import ServerConfig
from clipserve.metrics import Metrics
from clipserve.protocol.responses import encode_error
from clipserve.runtime import Runtime, build_runtime

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
    errors.Overloaded: 503,
    errors.NotReady: 503,
    errors.RequestTimeout: 504,
    errors.ExecutorFailed: 500,
}
CLIENT_CLOSED = 499  # nginx's code for "client closed request"; nobody reads the body


def status_for(error: errors.ClipserveError) -> int:
    for cls in type(error).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500


def _error_response(status: int, code: str, message: str) -> Response:
    return Response(encode_error(code, message), status, media_type="application/json")


async def _domain_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, errors.ClipserveError)
    status = status_for(exc)
    message = "internal error" if status == 500 else exc.message  # 500s stay opaque
    response = _error_response(status, exc.code, message)
    timer = getattr(request.state, "timer", None)
    if timer is not None and timer.stages:
        response.headers["Server-Timing"] = timer.header()
    if isinstance(exc, errors.Overloaded):
        response.headers["Retry-After"] = str(exc.retry_after_s)
    return response


async def _client_gone(request: Request, exc: Exception) -> Response:
    return _error_response(CLIENT_CLOSED, "client_closed", "client closed the request")


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.error("unhandled error, request id %s", getattr(request.state, "request_id", "?"),
              exc_info=exc)  # fmt: skip
    return _error_response(500, "internal", "internal error")


class RequestObserver:
    """Assigns a request id and counts every response by route and status, errors included."""

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: set[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        request_id = headers.get(b"x-request-id", b"").decode("latin-1")[:64] or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        route = scope["path"] if scope["path"] in self.routes else "other"
        status = 500
        t0 = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.request_duration.labels(route).observe(time.perf_counter() - t0)


def create_app(
    config: ServerConfig,
    runtime: Runtime | None = None,
    registry: CollectorRegistry | None = None,
) -> Starlette:
    """The ASGI app. Without a prebuilt `runtime`, the lifespan loads the model and warms up.

    The lifespan owns everything it starts: decode pool → batcher workers, torn down in
    reverse; the runtime's executors are closed on shutdown either way.
    """
    metrics = Metrics(registry)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, routes.ServerState]]:
        rt: Runtime = (
            runtime if runtime is not None else await asyncio.to_thread(build_runtime, config)
        )
        pool = ThreadPoolExecutor(
            rt.decode_workers(config.limits.decode_workers), thread_name_prefix="clipserve-decode"
        )
        batcher = Batcher(rt.executors, config.batching, metrics, rt.threads)
        # The text tower has its own queue and workers, on the same device threads.
        text_batcher = Batcher(rt.text_executors, config.batching, metrics, rt.threads, "text")
        metrics.add_scrape_time_gauges(
            batcher.depth,
            lambda: {
                ex.info.device: used for ex in rt.executors if (used := ex.memory()) is not None
            },
            lambda: {w.device: w.alive for w in batcher.workers},
        )
        batcher.start()
        text_batcher.start()
        app.state.server = routes.ServerState(config, rt, batcher, text_batcher, metrics, pool)
        log.info("serving %s with %s on %s", rt.model.identity, rt.backend,
                 ", ".join(ex.info.device for ex in rt.executors))  # fmt: skip
        try:
            yield {"server": app.state.server}
        finally:
            await asyncio.gather(batcher.stop(), text_batcher.stop())
            pool.shutdown(wait=True)
            rt.close()

    paths = {"/embed", "/embed/text", "/info", "/healthz", "/readyz", "/metrics"}
    app = Starlette(
        routes=[
            Route("/embed", routes.embed, methods=["POST"]),
            Route("/embed/text", routes.embed_text, methods=["POST"]),
            Route("/info", routes.info, methods=["GET"]),
            Route("/healthz", routes.healthz, methods=["GET"]),
            Route("/readyz", routes.readyz, methods=["GET"]),
            Route("/metrics", routes.metrics, methods=["GET"]),
        ],
        exception_handlers={
            errors.ClipserveError: _domain_error,
            routes.ClientGone: _client_gone,
            ClientDisconnect: _client_gone,
            Exception: _unexpected,
        },
        lifespan=lifespan,
    )
    app.add_middleware(RequestObserver, metrics=metrics, routes=paths)
    return app
