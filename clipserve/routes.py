"""HTTP handlers: thin. Parse, admit, decode off the loop, batch, encode."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive

from clipserve.batching import Batcher, Completed
from clipserve.config import ServerConfig
from clipserve.errors import (
    ClipserveError,
    InvalidParameter,
    PayloadTooLarge,
    RequestTimeout,
    with_item_index,
)
from clipserve.metrics import Metrics
from clipserve.protocol.media import media_type, negotiate
from clipserve.protocol.requests import Payload, check_media_type, parse_body
from clipserve.protocol.responses import RESPONSE_TYPES, encode_embeddings
from clipserve.runtime import Runtime
from clipserve.timing import StageTimer

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class ServerState:
    """Built by the lifespan, reached by handlers through `request.state.server`."""

    config: ServerConfig
    runtime: Runtime
    batcher: Batcher
    metrics: Metrics
    decode_pool: Any  # concurrent.futures.ThreadPoolExecutor


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def _server(request: Request) -> ServerState:
    return request.state.server  # type: ignore[no-any-return]


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"body of {declared} bytes exceeds {limit} (--max-body-bytes)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"body exceeds {limit} bytes (--max-body-bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


def _flag(request: Request, name: str, default: bool) -> bool:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes"):
        return True
    if value in ("0", "false", "no"):
        return False
    raise InvalidParameter(f"query parameter {name}={raw!r}: expected true or false")


async def _until_disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client goes away first (its items leave the queue)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def decode_all(state: ServerState, images: Sequence[bytes], single: bool) -> list[np.ndarray]:
    loop = asyncio.get_running_loop()
    jobs = [loop.run_in_executor(state.decode_pool, state.runtime.decoder, d) for d in images]
    results = await asyncio.gather(*jobs, return_exceptions=True)
    for index, result in enumerate(results):
        if isinstance(result, ClipserveError):
            raise result if single else with_item_index(result, index)
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]


async def _embed_payload(
    state: ServerState, request: Request, payload: Payload, timer: StageTimer, normalize: bool
) -> Completed:
    ticket = state.batcher.admit(len(payload))
    try:
        with timer.measure("decode"):
            if payload.tensor is not None:
                arrays: Sequence[np.ndarray] = list(payload.tensor)
            else:
                arrays = await decode_all(state, payload.images, payload.single)
        return await unless_disconnected(
            request.receive,
            state.batcher.run(
                ticket, arrays, normalize=normalize, request_id=request.state.request_id
            ),
        )
    finally:
        ticket.release_all()


async def embed(request: Request) -> Response:
    state = _server(request)
    limits = state.config.limits
    timer = StageTimer()
    media = media_type(request.headers.get("content-type"))
    check_media_type(media)
    response_type = negotiate(request.headers.get("accept"), RESPONSE_TYPES)
    normalize = _flag(request, "normalize", True)
    try:
        async with asyncio.timeout(limits.request_timeout_s):
            with timer.measure("receive"):
                body = await read_body(request, limits.max_body_bytes)
            payload = parse_body(media, body)
            completed = await _embed_payload(state, request, payload, timer, normalize)
    except TimeoutError:
        raise RequestTimeout(
            f"request took longer than {limits.request_timeout_s} s (--request-timeout-s)"
        ) from None
    timer.add("queue", completed.queue_s)
    timer.add("compute", completed.compute_s)
    model = state.runtime.model
    with timer.measure("encode"):
        content = encode_embeddings(
            completed.embeddings,
            single=payload.single,
            meta={"model": model.identity, "normalized": normalize},
            media=response_type,
        )
    for stage, seconds in timer.stages.items():
        state.metrics.stage_duration.labels(stage, payload.protocol).observe(seconds)
    state.metrics.request_bytes.labels(payload.protocol).inc(len(body))
    state.metrics.response_bytes.labels(payload.protocol).inc(len(content))
    return Response(content, media_type=response_type, headers={"Server-Timing": timer.header()})


async def info(request: Request) -> Response:
    state = _server(request)
    model, runtime, b = state.runtime.model, state.runtime, state.config.batching
    first = runtime.executors[0].info
    return JSONResponse(
        {
            "model": model.identity,
            "model_name": model.name,
            "weights": model.weights_id,
            "embed_dim": model.embed_dim,
            "input_size": list(model.preprocess.size),
            "input_layout": {"uint8": "NHWC", "float32": "NCHW", "float16": "NCHW"},
            "mean": list(model.preprocess.mean),
            "std": list(model.preprocess.std),
            "interpolation": model.preprocess.interpolation,
            "backend": runtime.backend,
            "precision": first.precision,
            "devices": [ex.info.device for ex in runtime.executors],
            "batching": {
                "max_batch_size": b.max_batch_size,
                "max_queue_size": b.max_queue_size,
                "max_queue_delay_ms": b.max_queue_delay_ms,
            },
            "limits": {
                "max_body_bytes": state.config.limits.max_body_bytes,
                "max_image_pixels": state.config.limits.max_image_pixels,
                "max_items_per_request": state.config.limits.max_items_per_request,
                "request_timeout_s": state.config.limits.request_timeout_s,
            },
        }
    )


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    workers = _server(request).batcher.workers
    status = {w.device: "ok" if w.alive else f"dead: {w.error}" for w in workers}
    ready = all(w.alive for w in workers)
    return JSONResponse({"ready": ready, "workers": status}, status_code=200 if ready else 503)


async def metrics(request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(_server(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)
