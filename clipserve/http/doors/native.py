"""HTTP handlers for clipserve's own API: thin. Each picks its codec, then walks the pipeline."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from clipserve.errors import InvalidParameter
from clipserve.http import pipeline
from clipserve.http.pipeline import ImageWork, Pipeline, TextWork
from clipserve.protocol.media import negotiate
from clipserve.protocol.requests import ImageCodec, image_codec
from clipserve.protocol.responses import RESPONSE_TYPES, encode_embeddings, out_dtype
from clipserve.protocol.text import text_protocol, texts_from


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


async def _image_work(p: Pipeline, request: Request, codec: ImageCodec, body: bytes) -> ImageWork:
    headers = request.headers
    tensor_headers = {k: headers[k] for k in ("x-tensor-dtype", "x-tensor-shape") if k in headers}
    args = (headers.get("content-type", ""), tensor_headers, body,
            p.runtime.model.preprocess.size, p.config.limits.max_items_per_request)  # fmt: skip
    payload = codec.parse(*args) if codec.inline else await p.in_pool(codec.parse, *args)
    if payload.tensor is not None:
        return ImageWork(payload.protocol, tensor=payload.tensor)
    return ImageWork(payload.protocol, images=payload.images, single=payload.single)


async def _embed(request: Request, tower: str) -> Response:
    """/embed and /embed/text: choose the codec, negotiate, read, admit, parse, embed, encode."""
    p = pipeline.of(request)
    content_type = request.headers.get("content-type", "")
    if tower == "image":
        codec = image_codec(content_type)  # 415 before the body is read
    else:
        protocol = text_protocol(content_type)
    response_type = negotiate(request.headers.get("accept"), RESPONSE_TYPES)
    normalize = _flag(request, "normalize", True)
    dtype = out_dtype(request.query_params.get("dtype"))
    limits = p.config.limits
    async with p.request(request) as ctx:
        body = await p.read_body(request, ctx)
        # One place is admitted before parsing (the pool's backlog stays bounded by the queue);
        # the pipeline grows it to the parsed request's size.
        if tower == "image":
            async with p.admitted(p.batcher, ctx) as admitted:
                with ctx.timer.measure("decode"):  # parsing the body counts as decoding
                    work = await _image_work(p, request, codec, body)
                protocol, single = work.protocol, work.single
                completed = await p.embed_images(work, ctx, normalize=normalize, admitted=admitted)
        else:
            async with p.admitted(p.text_batcher, ctx) as admitted:
                with ctx.timer.measure("decode"):
                    texts = await p.in_pool(texts_from, protocol, body,
                                            limits.max_items_per_request,
                                            limits.max_text_chars)  # fmt: skip
                single = False
                completed = await p.embed_texts(
                    TextWork(protocol, texts), ctx, normalize=normalize, admitted=admitted
                )
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
                "pipeline_depth": b.pipeline_depth,
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
