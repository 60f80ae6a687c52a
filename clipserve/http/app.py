"""`create_app(config)`: the Starlette app, its lifespan, its front doors and error pages."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from clipserve import errors
from clipserve.batching.tower import Tower
from clipserve.config import ServerConfig
from clipserve.engine.messages import ModelCard
from clipserve.http.doors import DOORS
from clipserve.http.observer import RequestObserver
from clipserve.http.pipeline import Pipeline, Serving
from clipserve.http.request import ClientGone
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


def create_app(
    config: ServerConfig,
    runtime: Runtime | None = None,
    registry: CollectorRegistry | None = None,
    engine: tuple[str, ModelCard] | None = None,
) -> Starlette:
    """The ASGI app. Without a prebuilt `runtime`, the lifespan loads the model and warms up;
    with `engine` (its socket and model card), a front end of the engine process instead.

    The lifespan owns everything it starts: towers -> decode pool, torn down in reverse; the
    runtime's executors are closed on shutdown either way.
    """
    metrics = Metrics(registry)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Pipeline[Any]]]:
        async with _towers(config, runtime, engine, metrics) as (rt, image, text):
            workers = rt.decode_workers(config.limits.decode_workers)
            pool = ThreadPoolExecutor(workers, thread_name_prefix="clipserve-decode")
            # Served with the config as resolved: batch and queue sizes for the devices.
            pipeline = Pipeline(rt.config, rt, image, text, metrics, pool)
            app.state.pipeline = pipeline
            devices = ", ".join(rt.devices)
            log.info("serving %s with %s on %s", rt.model.identity, rt.backend, devices)
            # What startup built (the model, torch: ~400k objects) lives as long as the server.
            # Out of the collector's sight, full collections under load stop stalling the loop
            # 0.3-0.8 s (bench/goodput.py: p99 of 503s 830 -> 15 ms).
            gc.freeze()
            try:
                yield {"pipeline": pipeline}
            finally:
                gc.unfreeze()
                pool.shutdown(wait=True)

    pages = ErrorPages(DOORS)
    app = Starlette(
        routes=[route for door in DOORS for route in door.routes()],
        exception_handlers={
            errors.ClipserveError: pages.domain_error,
            HTTPException: pages.http_error,
            ClientGone: pages.client_gone,
            ClientDisconnect: pages.client_gone,
        },
        lifespan=lifespan,
    )
    app.add_middleware(RequestObserver, metrics=metrics, pages=pages)
    return app
