"""Open Inference Protocol (KServe v2) routes, as Triton serves them over HTTP: health, server
and model metadata, and inference through the pipeline.

Two models: `<model name>` (the image tower) and `<model name>-text` (the text tower), each with
one version, "1".
"""

from __future__ import annotations

import functools
from typing import Literal

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from clipserve.errors import ModelNotFound, UnsupportedMediaType
from clipserve.http import pipeline
from clipserve.http.pipeline import ImageWork, Pipeline, TextWork
from clipserve.http.pipeline import Tower as Batching
from clipserve.protocol import kserve as codec
from clipserve.protocol.media import JSON

Tower = Literal["image", "text"]


def render_error(status: int, code: str, message: str) -> Response:
    """Triton's `{"error": "..."}`; tritonclient raises InferenceServerException with it."""
    status = 400 if status == 422 else status
    return Response(codec.encode_error(message), status, media_type=JSON)


def _json(doc: object) -> Response:
    return Response(orjson.dumps(doc), media_type=JSON)


def _empty(ok: bool) -> Response:
    """Health answers: the status is the answer, the body is empty (as the protocol asks)."""
    return Response(status_code=200 if ok else 503)


def _models(p: Pipeline) -> dict[str, Tower]:
    name = p.runtime.model.name
    return {name: "image", name + codec.TEXT_SUFFIX: "text"}


def _tower(request: Request) -> tuple[str, Tower]:
    p = pipeline.of(request)
    name: str = request.path_params["name"]
    models = _models(p)
    if name not in models:
        raise ModelNotFound(f"Request for unknown model: '{name}' is not found; this server "
                            f"serves {', '.join(repr(m) for m in models)}")  # fmt: skip
    version = request.path_params.get("version", codec.VERSION)
    if version != codec.VERSION:
        raise ModelNotFound(f"Request for unknown model: '{name}' version {version} is not "
                            f"found; its only version is {codec.VERSION}")  # fmt: skip
    return name, models[name]


def _batcher(p: Pipeline, tower: Tower) -> Batching:
    return p.batcher if tower == "image" else p.text_batcher


async def server_metadata(request: Request) -> Response:
    return _json(codec.server_metadata())


async def live(request: Request) -> Response:
    """Like /healthz: false once a tower has no live worker (a lost device does not return)."""
    p = pipeline.of(request)
    return _empty(p.batcher.alive and p.text_batcher.alive)


async def ready(request: Request) -> Response:
    """Like /readyz: true while every worker of both towers is alive."""
    p = pipeline.of(request)
    return _empty(all(w.alive for w in [*p.batcher.workers, *p.text_batcher.workers]))


async def model_ready(request: Request) -> Response:
    _, tower = _tower(request)
    return _empty(all(w.alive for w in _batcher(pipeline.of(request), tower).workers))


async def model_metadata(request: Request) -> Response:
    name, tower = _tower(request)
    model = pipeline.of(request).runtime.model
    return _json(codec.model_metadata(name, tower, model.preprocess.size, model.embed_dim))


async def infer(request: Request) -> Response:
    name, tower = _tower(request)
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding != "identity":
        raise UnsupportedMediaType(f"Content-Encoding {encoding[:40]} is not supported; send "
                                   "the request uncompressed")  # fmt: skip
    p = pipeline.of(request)
    limits, header_length = p.config.limits, request.headers.get(codec.HEADER_LENGTH)
    async with p.request(request) as ctx:
        body = await p.read_body(request, ctx)
        with ctx.timer.measure("decode"):  # parsing the body counts as decoding
            parsed = await p.in_pool(functools.partial(
                codec.parse_infer_request, body, header_length, tower=tower,
                size=p.runtime.model.preprocess.size, max_items=limits.max_items_per_request,
                max_text_chars=limits.max_text_chars,
            ))  # fmt: skip
        if tower == "text":
            completed = await p.embed_texts(TextWork(parsed.protocol, parsed.texts), ctx)
        else:
            work = ImageWork(parsed.protocol, images=parsed.images, tensor=parsed.tensor)
            completed = await p.embed_images(work, ctx)
    with ctx.timer.measure("encode"):
        content, headers, media = codec.encode_infer_response(
            completed.embeddings, model_name=name, request_id=parsed.id, outputs=parsed.outputs
        )
    return p.respond(ctx, parsed.protocol, content, media, headers)


_MODEL = "/v2/models/{name}"
_VERSION = "/v2/models/{name}/versions/{version}"
ROUTES = [
    Route("/v2", server_metadata, methods=["GET"]),
    Route("/v2/health/live", live, methods=["GET"]),
    Route("/v2/health/ready", ready, methods=["GET"]),
    *(
        route
        for prefix in (_MODEL, _VERSION)
        for route in (
            Route(prefix, model_metadata, methods=["GET"]),
            Route(prefix + "/ready", model_ready, methods=["GET"]),
            Route(prefix + "/infer", infer, methods=["POST"]),
        )
    ),
]
