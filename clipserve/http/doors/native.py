"""clipserve's own API: `POST /embed` and `/embed/text`, `GET /info`, the probes and `/metrics`.

Images come as JPEG/PNG/WebP bodies, multipart, msgpack, JSON or raw tensors (protocol/requests.py);
answers as JSON, msgpack or raw float32/float16, chosen by `Accept`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import QueryParams
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from clipserve.batching.tower import Completed, TowerKind
from clipserve.config import LimitsConfig
from clipserve.errors import InvalidParameter
from clipserve.http import health
from clipserve.http.door import inference_route
from clipserve.http.info import info_card
from clipserve.http.pipeline import Pipeline, Serving, pipeline_of
from clipserve.http.status import native_error
from clipserve.http.work import Embedded, Encoded, ImageWork, TextWork, Work
from clipserve.protocol.media import media_type, negotiate
from clipserve.protocol.requests import RAW_TENSOR, ImageCodec, image_codec
from clipserve.protocol.responses import RESPONSE_TYPES, encode_embeddings, out_dtype
from clipserve.protocol.text import text_protocol, texts_from

TENSOR_HEADERS = ("x-tensor-dtype", "x-tensor-shape")


def _flag(query: QueryParams, name: str, default: bool) -> bool:
    raw = query.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes"):
        return True
    if value in ("0", "false", "no"):
        return False
    raise InvalidParameter(f"query parameter {name}={raw[:40]!r}: expected true or false")


# Clients send the same few Accept headers over and over; a refused one raises (not cached).
_negotiate = functools.lru_cache(maxsize=256)(negotiate)


@dataclass(frozen=True)
class Answer:
    """What the client asked of the answer: its media type (`Accept`), `?dtype=`, `?normalize=`."""

    media: str
    dtype: str
    normalize: bool

    @classmethod
    def of(cls, request: Request) -> Answer:
        return _answer(request.headers.get("accept"), request.scope.get("query_string", b""))

    @classmethod
    def parse(cls, accept: str | None, query_string: bytes) -> Answer:
        """406 for an Accept it cannot meet, 400 for a bad `?normalize=` or `?dtype=`."""
        media = _negotiate(accept, RESPONSE_TYPES)
        query = QueryParams(query_string)
        normalize = _flag(query, "normalize", True)
        return cls(media, out_dtype(query.get("dtype")), normalize)

    def encode(self, runtime: Serving, completed: Completed | None, single: bool) -> Encoded:
        assert completed is not None
        meta = {"model": runtime.model.identity, "normalized": self.normalize}
        content, headers = encode_embeddings(
            completed.embeddings, single=single, meta=meta, media=self.media, dtype=self.dtype
        )
        return Encoded(content, self.media, headers)


# Clients send the same few Accept headers and query strings over and over: an answer's
# choices are read once per pair (frozen, so shared); a refused pair raises, not cached.
_answer = functools.lru_cache(maxsize=256)(Answer.parse)


@functools.lru_cache(maxsize=256)
def _image_codec(content_type: str, tensor_dtype: str | None) -> tuple[ImageCodec, bool]:
    """The codec for a Content-Type (415 before the body is read), and whether its parse is
    cheap enough for the event loop: one encoded image, or a uint8 raw tensor (a few checks
    and a view of the body: a hop to the pool costs more). Float tensors are range-checked:
    in the pool."""
    codec = image_codec(content_type)
    dtype = (tensor_dtype or "").strip().lower()
    return codec, codec.inline or (media_type(content_type) == RAW_TENSOR and dtype == "uint8")


@dataclass(frozen=True)
class EmbedImages:
    """`POST /embed`: the codec is chosen by Content-Type before the body is read (415)."""

    runtime: Serving
    codec: ImageCodec
    content_type: str
    tensor_headers: dict[str, str]
    answer: Answer
    max_items: int
    fetch_urls: bool
    inline: bool
    tower: TowerKind = "image"

    @classmethod
    def of(cls, request: Request, pipeline: Pipeline[Any]) -> EmbedImages:
        headers = request.headers
        content_type = headers.get("content-type", "")
        tensor_headers = {k: v for k in TENSOR_HEADERS if (v := headers.get(k)) is not None}
        codec, inline = _image_codec(content_type, tensor_headers.get("x-tensor-dtype"))
        limit = pipeline.config.limits.max_items_per_request
        answer = Answer.of(request)
        fetch = pipeline.fetcher.enabled
        return cls(
            pipeline.runtime, codec, content_type, tensor_headers, answer, limit, fetch, inline
        )

    def parse(self, body: bytes) -> Work[bool]:
        size = self.runtime.model.preprocess.size
        payload = self.codec.parse(
            self.content_type, self.tensor_headers, body, size, self.max_items, self.fetch_urls
        )
        if payload.tensor is not None:
            images = ImageWork(payload.protocol, tensor=payload.tensor)
        else:
            images = ImageWork(
                payload.protocol, payload.images, single=payload.single, urls=payload.urls
            )
        return Work(payload.protocol, images.single, images=images, normalize=self.answer.normalize)

    def encode(self, work: Work[bool], done: Embedded) -> Encoded:
        return self.answer.encode(self.runtime, done.images, single=work.parsed)


@dataclass(frozen=True)
class EmbedTexts:
    """`POST /embed/text`: {"texts": [...]} as JSON or msgpack; tokenised as it is parsed."""

    runtime: Serving
    protocol: str
    answer: Answer
    limits: LimitsConfig
    tower: TowerKind = "text"
    inline: bool = False

    @classmethod
    def of(cls, request: Request, pipeline: Pipeline[Any]) -> EmbedTexts:
        protocol = text_protocol(request.headers.get("content-type", ""))  # 415 before the body
        return cls(pipeline.runtime, protocol, Answer.of(request), pipeline.config.limits)

    def parse(self, body: bytes) -> Work[None]:
        lim = self.limits
        truncate = lim.truncate_text
        texts = texts_from(
            self.protocol, body, lim.max_items_per_request, lim.max_text_chars, truncate=truncate
        )
        tokens = self.runtime.tokenize(texts, truncate=truncate)
        work = TextWork(self.protocol, texts, tokens)
        return Work(self.protocol, None, texts=work, normalize=self.answer.normalize)

    def encode(self, work: Work[None], done: Embedded) -> Encoded:
        return self.answer.encode(self.runtime, done.texts, single=False)


async def info(request: Request) -> Response:
    pipeline = pipeline_of(request)
    return JSONResponse(info_card(pipeline.runtime, pipeline.config, pipeline.names))


async def healthz(request: Request) -> Response:
    """Liveness (see `health.Liveness`)."""
    live = health.liveness(pipeline_of(request).towers)
    if not live.ok:
        return JSONResponse({"status": "failing", "reason": live.reason}, status_code=503)
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    ready = pipeline_of(request).readiness()
    body: dict[str, object] = {"ready": ready.ok, "workers": ready.workers}
    if ready.stopping:
        body["stopping"] = True
    return JSONResponse(body, status_code=200 if ready.ok else 503)


async def metrics(request: Request) -> Response:
    return Response(pipeline_of(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


class NativeDoor:
    """Every path no other door claims answers errors as {"error": {"code", "message"}}."""

    error_prefixes = ("",)

    def routes(self) -> Sequence[BaseRoute]:
        return [
            inference_route("/embed", EmbedImages.of),
            inference_route("/embed/text", EmbedTexts.of),
            Route("/info", info, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ]

    def render_error(self, status: int, code: str, message: str) -> Response:
        return native_error(status, code, message)
