"""OpenAI-compatible routes: `POST /v1/embeddings`, `GET /v1/models[/{model}]`.

Texts go to the text tower and images to the image tower; a list that mixes them runs both at
once and is answered in input order. Errors come in OpenAI's shape, so its clients raise their
usual exceptions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from clipserve.batching.tower import TowerKind
from clipserve.config import LimitsConfig
from clipserve.errors import ModelNotFound
from clipserve.http.door import inference_route
from clipserve.http.pipeline import Pipeline, Serving, pipeline_of
from clipserve.http.work import Embedded, Encoded, ImageWork, TextWork, Work
from clipserve.protocol import openai as codec
from clipserve.protocol.media import JSON

CREATED = 0  # OpenAI's `created` (a Unix time); a served checkpoint has no creation date
# Statuses OpenAI uses where clipserve's own API says otherwise: a bad field (422 there) or an
# input over a per-item limit is a 400 ("invalid request"); a body over the limit stays 413.
_STATUS = {422: 400}
_PER_ITEM_LIMITS = ("too_many_items", "too_many_texts", "text_too_long", "image_too_large")


@dataclass(frozen=True)
class Usage:
    request: codec.EmbeddingsRequest
    prompt_tokens: int  # CLIP tokens of the texts, one per image


@dataclass(frozen=True)
class Embeddings:
    """`POST /v1/embeddings`. The one place admitted before parsing is a text's (the usual
    input); a request of images only gives it back and is admitted to the image tower."""

    runtime: Serving
    limits: LimitsConfig
    models: tuple[str, ...]
    fetch_urls: bool
    tower: TowerKind = "text"
    inline: bool = False

    @classmethod
    def of(cls, request: Request, pipeline: Pipeline[Any]) -> Embeddings:
        fetch = pipeline.fetcher.enabled
        return cls(pipeline.runtime, pipeline.config.limits, pipeline.names.openai, fetch)

    def parse(self, body: bytes) -> Work[Usage]:
        """The request and its texts' tokens, once: they serve the model and the usage."""
        model = self.runtime.model
        parsed = codec.parse_embeddings_request(
            body,
            models=self.models,
            embed_dim=model.embed_dim,
            max_items=self.limits.max_items_per_request,
            max_text_chars=self.limits.max_text_chars,
            truncate=self.limits.truncate_text,
            fetch_urls=self.fetch_urls,
        )
        protocol = parsed.protocol
        work = Work(protocol, Usage(parsed, len(parsed.images)))
        if parsed.texts:
            tokens = self.runtime.tokenize(
                parsed.texts, truncate=parsed.truncate, positions=parsed.text_index
            )
            # What the model reads, start and end tokens included; an image counts as one.
            used = model.tokens_seen(tokens) + len(parsed.images)
            work.parsed = Usage(parsed, used)
            work.texts = TextWork(protocol, parsed.texts, tokens)
        if parsed.images:
            work.images = ImageWork(
                protocol, parsed.images, positions=parsed.image_index, urls=parsed.urls
            )
        return work

    def encode(self, work: Work[Usage], done: Embedded) -> Encoded:
        parsed = work.parsed.request
        parts = [
            (index, completed.embeddings)
            for index, completed in (
                (parsed.text_index, done.texts),
                (parsed.image_index, done.images),
            )
            if completed is not None
        ]
        content = codec.encode_embeddings_response(
            codec.merge(parsed.count, parts),
            model=parsed.model,
            encoding_format=parsed.encoding_format,
            prompt_tokens=work.parsed.prompt_tokens,
        )
        return Encoded(content, JSON)


async def list_models(request: Request) -> Response:
    names = pipeline_of(request).names.openai
    return Response(codec.encode_models(names, CREATED), media_type=JSON)


async def get_model(request: Request) -> Response:
    names = pipeline_of(request).names.openai
    model: str = request.path_params["model"]
    if model not in names:
        served = ", ".join(names)
        raise ModelNotFound(f"The model {model!r} does not exist; this server serves {served}")
    return Response(codec.encode_model(model, CREATED), media_type=JSON)


class OpenAIDoor:
    error_prefixes = ("/v1/",)

    def routes(self) -> Sequence[BaseRoute]:
        return [
            inference_route("/v1/embeddings", Embeddings.of),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        ]

    def render_error(self, status: int, code: str, message: str) -> Response:
        status = 400 if code in _PER_ITEM_LIMITS else _STATUS.get(status, status)
        return Response(codec.encode_error(message, status, code), status, media_type=JSON)
