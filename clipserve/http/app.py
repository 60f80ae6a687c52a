"""`create_app(config)`: the Starlette app, its lifespan, its front doors and error pages."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.exceptions import ExceptionMiddleware
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp

from clipserve import collector, errors
from clipserve.batching.tower import Tower
from clipserve.config import ServerConfig
from clipserve.engine.messages import ModelCard
from clipserve.http.access import Access, AccessGuard, MeteredTower
from clipserve.http.doors import DOORS
from clipserve.http.fastlane import FastLane, Handler, InferenceRoutes
from clipserve.http.observer import RequestObserver, request_tracing
from clipserve.http.pipeline import Pipeline, Serving
from clipserve.http.request import BodyBudget, ClientGone
from clipserve.http.shm_regions import SharedMemoryRegions
from clipserve.http.status import ErrorPages
from clipserve.inference.runtime import Runtime, build_runtime
from clipserve.inference.towers import Towers, add_status_gauges
from clipserve.metrics import Metrics

log = logging.getLogger(__name__)
ENGINE_CONNECT_TIMEOUT_S = 60.0


@asynccontextmanager
async def _towers(
    config: ServerConfig,
    runtime: Runtime | None,
    engine: tuple[str, ModelCard] | None,
    metrics: Metrics,
) -> AsyncIterator[tuple[Serving, Tower[Any], Tower[Any]]]:
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


@contextlib.contextmanager
def _access_running(access: Access | None) -> Iterator[None]:
    """The key file's watcher, and SIGHUP to reload it when this thread may take signals (the
    main one: not in-process test servers, whose uvicorn runs in a thread)."""
    if access is None:
        yield
        return
    access.start()
    loop = asyncio.get_running_loop()
    before = signal.getsignal(signal.SIGHUP)
    hangup = False
    if access.keys is not None:
        with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
            loop.add_signal_handler(signal.SIGHUP, access.keys.reload_soon)
            hangup = True
    try:
        yield
    finally:
        if hangup:  # as it was (a front end ignores it), not the default, which kills
            loop.remove_signal_handler(signal.SIGHUP)
            if before is not None:
                signal.signal(signal.SIGHUP, before)
        access.close()


@asynccontextmanager
async def _grpc_serving(
    app: Starlette, pipeline: Pipeline[Any], access: Access | None, shared_port: bool
) -> AsyncIterator[None]:
    """Triton's gRPC service on --grpc-port (0: off), from once the towers are up (as HTTP)
    until the drain: `app.state.drain` stops it taking calls when uvicorn starts draining,
    and the calls in flight get --drain-timeout-s to finish."""
    config = pipeline.config
    app.state.grpc_port = None
    if not config.http.grpc_port:
        yield
        return
    from clipserve.http.doors.kserve_grpc import InferenceServicer
    from clipserve.http.grpc_server import build_grpc_server

    servicer = InferenceServicer(pipeline)
    server, port = build_grpc_server(
        config, servicer, pipeline.metrics, access, reuse_port=shared_port
    )
    await server.start()
    app.state.grpc_port = port
    stopping: list[asyncio.Task[None]] = []

    def drain() -> None:
        if not stopping:
            stopping.append(asyncio.ensure_future(server.stop(config.http.drain_timeout_s)))

    app.state.drain = drain
    log.info("gRPC (KServe v2 / Triton) on %s:%d", config.http.host, port)
    try:
        yield
    finally:
        drain()
        await stopping[0]


def _self_check_gauges(metrics: Metrics, checked: dict[str, Any] | None) -> None:
    if checked is None:
        return
    for tower, prefix in (("image", ""), ("text", "text_")):
        if checked[prefix + "min_cosine"] is not None:  # None: not checked (--self-check off)
            metrics.self_check_min_cosine.labels(tower).set(checked[prefix + "min_cosine"])
            metrics.self_check_floor.labels(tower).set(checked[prefix + "floor"])


def _body_budget(config: ServerConfig, front_end: tuple[int, int] | None) -> BodyBudget:
    """--max-body-bytes-in-flight: this process's, or the table every front end shares."""
    capacity = config.limits.max_body_bytes_in_flight
    if front_end is None:
        return BodyBudget(capacity)
    from clipserve.http.body_budget import SharedBodyBudget, budget_path

    supervisor, index = front_end
    return SharedBodyBudget(capacity, budget_path(supervisor), index, config.http.workers)


def _shm_regions(config: ServerConfig, front_end: tuple[int, int] | None) -> SharedMemoryRegions:
    """Triton's shared-memory regions: this process's, or a table every front end shares
    (removed with the supervisor's other files)."""
    lim = config.limits
    table = None
    if front_end is not None:
        from clipserve.engine.slots import segment_prefix, shm_dir

        table = shm_dir() / f"{segment_prefix(front_end[0])}shm-regions.json"
    return SharedMemoryRegions(lim.shm_max_regions, lim.shm_max_bytes, table)


class _Served(Starlette):
    """Starlette less its ServerErrorMiddleware, which sits outside every other layer: the
    request observer, outermost of ours, answers each unhandled error itself (an opaque JSON
    500, logged with the request id), so that layer never saw one, yet wrapped every `send`."""

    def build_middleware_stack(self) -> ASGIApp:
        handlers = self.exception_handlers
        app: ASGIApp = ExceptionMiddleware(self.router, handlers=handlers, debug=self.debug)
        for cls, args, kwargs in reversed(self.user_middleware):
            app = cls(app, *args, **kwargs)
        return app


def create_app(
    config: ServerConfig,
    runtime: Runtime | None = None,
    registry: CollectorRegistry | None = None,
    engine: tuple[str, ModelCard] | None = None,
    buckets: str | None = None,
    front_end: tuple[int, int] | None = None,
) -> Starlette:
    """The ASGI app. Without a prebuilt `runtime`, the lifespan loads the model and warms up;
    with `engine` (its socket and model card), a front end of the engine process instead.
    `buckets`: the rate limits' table shared by the front ends (--workers N). `front_end`:
    this front end's supervisor pid and index, where the front ends share a body budget. A
    bad key file or rate limit raises StartupError here, before anything starts.

    The lifespan owns everything it starts: towers -> decode pool, torn down in reverse; the
    runtime's executors are closed on shutdown either way.
    """
    metrics = Metrics(registry)
    access = Access.build(config.access, metrics.registry, buckets)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Pipeline[Any]]]:
        async with _towers(config, runtime, engine, metrics) as (rt, image, text):
            if access is not None:  # every place reserved costs the request's key a token
                image, text = MeteredTower(image, access), MeteredTower(text, access)
            workers = rt.decode_workers(config.limits.decode_workers)
            pool = ThreadPoolExecutor(workers, thread_name_prefix="clipserve-decode")
            # Served with the config as resolved: batch and queue sizes for the devices.
            budget = _body_budget(config, front_end)
            regions = _shm_regions(config, front_end)
            pipeline = Pipeline(rt.config, rt, image, text, metrics, pool, budget, regions)
            app.state.pipeline = pipeline
            _self_check_gauges(metrics, rt.self_check)
            devices = ", ".join(rt.devices)
            log.info("serving %s with %s on %s", rt.model.identity, rt.backend, devices)
            try:
                with collector.serving(), _access_running(access):
                    async with _grpc_serving(app, pipeline, access, front_end is not None):
                        yield {"pipeline": pipeline}
            finally:
                pool.shutdown(wait=True)
                budget.close()
                metrics.deferred.flush()  # under --workers N, others read this one's files

    pages = ErrorPages(DOORS)
    handlers: dict[Any, Handler] = {
        errors.ClipserveError: pages.domain_error,
        HTTPException: pages.http_error,
        ClientGone: pages.client_gone,
        ClientDisconnect: pages.client_gone,
    }
    routes = [route for door in DOORS for route in door.routes()]
    app = _Served(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    # Innermost of ours: inference POSTs skip Starlette's own layers (http/fastlane.py).
    inference = InferenceRoutes(routes)
    app.add_middleware(FastLane, routes=inference, handlers=handlers)
    if access is not None:  # inside the observer: its answers get a request id and a count
        app.add_middleware(AccessGuard, access=access, pages=pages, inference=inference.find)
    tracing = request_tracing(config.http.otel_endpoint)
    app.add_middleware(RequestObserver, metrics=metrics, pages=pages, tracing=tracing)
    return app
