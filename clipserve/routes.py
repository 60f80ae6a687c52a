"""HTTP handlers: thin. Parse, admit, decode off the loop, batch, encode."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
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
from clipserve.protocol.requests import (
    IMAGE_TYPES,
    REQUEST_TYPES,
    check_media_type,
    parse_body,
)
from clipserve.protocol.responses import RESPONSE_TYPES, encode_embeddings, out_dtype
from clipserve.protocol.text import TEXT_TYPES, parse_texts
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
    text_batcher: Batcher
    metrics: Metrics
    decode_pool: ThreadPoolExecutor


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


async def in_pool(state: ServerState, fn: Callable[..., T], *args: Any) -> T:
    """CPU work (parsing, decoding, tokenising) goes to the pool, never onto the event loop."""
    return await asyncio.get_running_loop().run_in_executor(state.decode_pool, fn, *args)


async def decode_all(state: ServerState, images: Sequence[bytes], single: bool) -> list[np.ndarray]:
    jobs = [in_pool(state, state.runtime.decoder, data) for data in images]
    results = await asyncio.gather(*jobs, return_exceptions=True)
    for index, result in enumerate(results):
        if isinstance(result, ClipserveError):
            raise result if single else with_item_index(result, index)
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]


@dataclass
class Job:
    """One request on its way through admission, preparation and a batcher."""

    protocol: str
    count: int
    prepare: Callable[[], Awaitable[Sequence[np.ndarray]]]
    single: bool = False


Parser = Callable[[ServerState, Mapping[str, str], bytes], Awaitable[Job]]


async def _run(request: Request, batcher: Batcher, job: Job, timer: StageTimer,
               normalize: bool) -> Completed:  # fmt: skip
    ticket = batcher.admit(job.count)  # before decoding: the backlog stays bounded
    try:
        with timer.measure("decode"):
            arrays = await job.prepare()
        return await unless_disconnected(
            request.receive,
            batcher.run(ticket, arrays, normalize=normalize, request_id=request.state.request_id),
        )
    finally:
        ticket.release_all()


async def _serve(request: Request, batcher: Batcher, parse: Parser,
                 accepted: tuple[str, ...]) -> Response:  # fmt: skip
    """The shared shape of /embed and /embed/text: everything before and after the batcher."""
    state = _server(request)
    limits = state.config.limits
    check_media_type(media_type(request.headers.get("content-type")), accepted)
    response_type = negotiate(request.headers.get("accept"), RESPONSE_TYPES)
    normalize = _flag(request, "normalize", True)
    dtype = out_dtype(request.query_params.get("dtype"))
    timer = request.state.timer = StageTimer()  # error responses report the stages done too
    try:
        async with asyncio.timeout(limits.request_timeout_s):
            with timer.measure("receive"):
                body = await read_body(request, limits.max_body_bytes)
            with timer.measure("decode"):  # parsing the body counts as decoding
                job = await parse(state, request.headers, body)
            completed = await _run(request, batcher, job, timer, normalize)
    except TimeoutError:
        raise RequestTimeout(
            f"request took longer than {limits.request_timeout_s} s (--request-timeout-s)"
        ) from None
    timer.add("queue", completed.queue_s)
    timer.add("compute", completed.compute_s)
    with timer.measure("encode"):
        content, headers = encode_embeddings(
            completed.embeddings,
            single=job.single,
            meta={"model": state.runtime.model.identity, "normalized": normalize},
            media=response_type,
            dtype=dtype,
        )
    metrics = state.metrics
    for stage, seconds in timer.stages.items():
        metrics.stage_duration.labels(stage, job.protocol).observe(seconds)
    metrics.request_bytes.labels(job.protocol).inc(len(body))
    metrics.response_bytes.labels(job.protocol).inc(len(content))
    headers["Server-Timing"] = timer.header()
    return Response(content, media_type=response_type, headers=headers)


async def _image_job(state: ServerState, headers: Mapping[str, str], body: bytes) -> Job:
    tensor_headers = {k: headers[k] for k in ("x-tensor-dtype", "x-tensor-shape") if k in headers}
    content_type = headers.get("content-type", "")
    args = (content_type, tensor_headers, body, state.runtime.model.preprocess.size,
            state.config.limits.max_items_per_request)  # fmt: skip
    if media_type(content_type) in IMAGE_TYPES:
        payload = parse_body(*args)  # one encoded image: nothing to parse, no hop to the pool
    else:
        payload = await in_pool(state, parse_body, *args)
    tensor = payload.tensor
    if tensor is not None:

        async def views() -> Sequence[np.ndarray]:
            return list(tensor)  # zero-copy rows; stacked on the device thread

        return Job(payload.protocol, len(payload), views)

    async def decoded() -> Sequence[np.ndarray]:
        return await decode_all(state, payload.images, payload.single)

    return Job(payload.protocol, len(payload), decoded, single=payload.single)


async def _text_job(state: ServerState, headers: Mapping[str, str], body: bytes) -> Job:
    limits = state.config.limits
    content_type = headers.get("content-type", "")
    texts = await in_pool(state, parse_texts, content_type, body,
                          limits.max_items_per_request, limits.max_text_chars)  # fmt: skip
    protocol = "text-json" if media_type(content_type) == "application/json" else "text-msgpack"

    async def tokens() -> Sequence[np.ndarray]:
        return list(await in_pool(state, state.runtime.tokenize, texts))

    return Job(protocol, len(texts), tokens)


async def embed(request: Request) -> Response:
    return await _serve(request, _server(request).batcher, _image_job, REQUEST_TYPES)


async def embed_text(request: Request) -> Response:
    return await _serve(request, _server(request).text_batcher, _text_job, TEXT_TYPES)


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
            "text": {
                "context_length": model.context_length,
                "max_text_chars": state.config.limits.max_text_chars,
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
    state = _server(request)
    workers = state.batcher.workers + state.text_batcher.workers
    status = {
        (w.device if w.kind == "image" else f"{w.kind}:{w.device}"): (
            "ok" if w.alive else f"dead: {w.error}"
        )
        for w in workers
    }
    ready = all(w.alive for w in workers)
    return JSONResponse({"ready": ready, "workers": status}, status_code=200 if ready else 503)


async def metrics(request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(_server(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)
