"""HTTP handlers for clipserve's own API: thin. Each picks its codec, then walks the pipeline."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from clipserve import pipeline
from clipserve.errors import InvalidParameter
from clipserve.pipeline import ImageWork, Pipeline, TextWork
from clipserve.protocol.media import media_type, negotiate
from clipserve.protocol.requests import IMAGE_TYPES, REQUEST_TYPES, check_media_type, parse_body
from clipserve.protocol.responses import RESPONSE_TYPES, encode_embeddings, out_dtype
from clipserve.protocol.text import TEXT_TYPES, parse_texts


def _flag(request: Request, name: str, default: bool) -> bool:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes"):
        return True
    if value in ("0", "false", "no"):
        return False
    raise InvalidParameter(f"query parameter {name}={raw[:40]!r}: expected true or false")


async def _image_work(p: Pipeline, request: Request, body: bytes) -> ImageWork:
    headers = request.headers
    tensor_headers = {k: headers[k] for k in ("x-tensor-dtype", "x-tensor-shape") if k in headers}
    content_type = headers.get("content-type", "")
    args = (content_type, tensor_headers, body, p.runtime.model.preprocess.size,
            p.config.limits.max_items_per_request)  # fmt: skip
    if media_type(content_type) in IMAGE_TYPES:
        payload = parse_body(*args)  # one encoded image: nothing to parse, no hop to the pool
    else:
        payload = await p.in_pool(parse_body, *args)
    if payload.tensor is not None:
        return ImageWork(payload.protocol, tensor=payload.tensor)
    return ImageWork(payload.protocol, images=payload.images, single=payload.single)


async def _text_work(p: Pipeline, request: Request, body: bytes) -> TextWork:
    limits = p.config.limits
    content_type = request.headers.get("content-type", "")
    texts = await p.in_pool(parse_texts, content_type, body,
                            limits.max_items_per_request, limits.max_text_chars)  # fmt: skip
    protocol = "text-json" if media_type(content_type) == "application/json" else "text-msgpack"
    return TextWork(protocol, texts)


async def _embed(request: Request, tower: str) -> Response:
    """/embed and /embed/text: negotiate, read, parse, embed, encode."""
    p = pipeline.of(request)
    check_media_type(
        media_type(request.headers.get("content-type")),
        REQUEST_TYPES if tower == "image" else TEXT_TYPES,
    )
    response_type = negotiate(request.headers.get("accept"), RESPONSE_TYPES)
    normalize = _flag(request, "normalize", True)
    dtype = out_dtype(request.query_params.get("dtype"))
    async with p.request(request) as ctx:
        body = await p.read_body(request, ctx)
        if tower == "image":
            with ctx.timer.measure("decode"):  # parsing the body counts as decoding
                work = await _image_work(p, request, body)
            protocol, single = work.protocol, work.single
            completed = await p.embed_images(work, ctx, normalize=normalize)
        else:
            with ctx.timer.measure("decode"):
                text_work = await _text_work(p, request, body)
            protocol, single = text_work.protocol, False
            completed = await p.embed_texts(text_work, ctx, normalize=normalize)
    with ctx.timer.measure("encode"):
        content, headers = encode_embeddings(
            completed.embeddings,
            single=single,
            meta={"model": p.runtime.model.identity, "normalized": normalize},
            media=response_type,
            dtype=dtype,
        )
    return p.respond(ctx, protocol, content, response_type, headers)


async def embed(request: Request) -> Response:
    return await _embed(request, "image")


async def embed_text(request: Request) -> Response:
    return await _embed(request, "text")


async def info(request: Request) -> Response:
    state = pipeline.of(request)
    model, runtime, b = state.runtime.model, state.runtime, state.config.batching
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
            "precision": runtime.precision,
            "devices": runtime.devices,
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
                "max_image_aspect": state.config.limits.max_image_aspect,
                "max_decode_bytes": state.config.limits.max_decode_bytes,
                "max_items_per_request": state.config.limits.max_items_per_request,
                "max_body_bytes_in_flight": state.config.limits.max_body_bytes_in_flight,
                "request_timeout_s": state.config.limits.request_timeout_s,
                "max_connections": state.config.http.max_connections,
                "max_header_bytes": state.config.http.max_header_bytes,
                "header_timeout_s": state.config.http.header_timeout_s,
            },
        }
    )


async def healthz(request: Request) -> Response:
    """Liveness: fails once a tower has no live worker, so the orchestrator restarts the
    process (a lost device does not come back by itself)."""
    p = pipeline.of(request)
    dead = [kind for kind, b in (("image", p.batcher), ("text", p.text_batcher)) if not b.alive]
    if dead:
        reason = "; ".join(f"{kind} tower: no live worker" for kind in dead)
        return JSONResponse({"status": "failing", "reason": reason}, status_code=503)
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    state = pipeline.of(request)
    workers = [*state.batcher.workers, *state.text_batcher.workers]
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

    return Response(pipeline.of(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)
