"""OpenAI-compatible routes: `POST /v1/embeddings`, `GET /v1/models[/{model}]`.

Texts go to the text tower and images to the image tower, both through the pipeline; a list
that mixes them runs both at once and is answered in input order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import TypeVar

import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from clipserve.batching import Completed
from clipserve.errors import ModelNotFound
from clipserve.http import pipeline
from clipserve.http.pipeline import ImageWork, Pipeline, TextWork
from clipserve.protocol import openai as codec
from clipserve.protocol.media import JSON

T = TypeVar("T")
CREATED = 0  # OpenAI's `created` (a Unix time); a served checkpoint has no creation date
# Statuses OpenAI uses where clipserve's own API says otherwise: a bad field (422 there) or an
# input over a per-item limit is a 400 ("invalid request"); a body over the limit stays 413.
_STATUS = {422: 400}
_STATUS_OF_CODE = {"too_many_items": 400, "too_many_texts": 400, "text_too_long": 400,
                   "image_too_large": 400}  # fmt: skip


def model_names(p: Pipeline) -> list[str]:
    """The served model's identity (name/weights), then its bare name as an alias."""
    model = p.runtime.model
    return list(dict.fromkeys([model.identity, model.name]))


def render_error(status: int, code: str, message: str) -> Response:
    """Errors on /v1/ in OpenAI's shape, so its clients raise their usual exceptions."""
    status = _STATUS_OF_CODE.get(code, _STATUS.get(status, status))
    return Response(codec.encode_error(message, status, code), status, media_type=JSON)


def _parse(p: Pipeline, body: bytes) -> tuple[codec.EmbeddingsRequest, np.ndarray | None, int]:
    """Pool work: the request, its texts' tokens (once: they serve the model and the usage),
    and the usage (CLIP tokens of the texts, one per image)."""
    limits = p.config.limits
    parsed = codec.parse_embeddings_request(
        body, models=model_names(p), embed_dim=p.runtime.model.embed_dim,
        max_items=limits.max_items_per_request, max_text_chars=limits.max_text_chars,
    )  # fmt: skip
    tokens = p.runtime.tokenize(parsed.texts) if parsed.texts else None
    # The tokenizer pads with 0 and counts start/end tokens, like the model.
    used = 0 if tokens is None else int(np.count_nonzero(tokens))
    return parsed, tokens, used + len(parsed.images)


async def _all(jobs: Sequence[Awaitable[T]]) -> list[T]:
    """Await every job; the first failure cancels the others (their items leave the queue)."""
    tasks = [asyncio.ensure_future(job) for job in jobs]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in tasks:  # the failure itself, not a sibling's cancellation
        error = None if task.cancelled() else task.exception()
        if error is not None:
            raise error
    return [task.result() for task in tasks]


async def embeddings(request: Request) -> Response:
    p = pipeline.of(request)
    async with p.request(request) as ctx:
        body = await p.read_body(request, ctx)
        with ctx.timer.measure("decode"):
            parsed, text_tokens, tokens = await p.in_pool(_parse, p, body)
        protocol = parsed.protocol
        jobs: list[Awaitable[Completed]] = []
        if parsed.texts:
            jobs.append(p.embed_texts(TextWork(protocol, parsed.texts, text_tokens), ctx))
        if parsed.images:
            work = ImageWork(protocol, images=parsed.images, positions=parsed.image_index)
            jobs.append(p.embed_images(work, ctx))
        completed = await _all(jobs)
    with ctx.timer.measure("encode"):
        indices = [i for i in (parsed.text_index, parsed.image_index) if i]
        embedded = codec.merge(parsed.count, [
            (index, c.embeddings) for index, c in zip(indices, completed, strict=True)
        ])  # fmt: skip
        content = codec.encode_embeddings_response(
            embedded, model=parsed.model, encoding_format=parsed.encoding_format,
            prompt_tokens=tokens,
        )  # fmt: skip
    return p.respond(ctx, protocol, content, JSON)


async def list_models(request: Request) -> Response:
    return Response(codec.encode_models(model_names(pipeline.of(request)), CREATED),
                    media_type=JSON)  # fmt: skip


async def get_model(request: Request) -> Response:
    names = model_names(pipeline.of(request))
    model: str = request.path_params["model"]
    if model not in names:
        raise ModelNotFound(f"The model {model!r} does not exist; this server serves "
                            f"{', '.join(names)}")  # fmt: skip
    return Response(codec.encode_model(model, CREATED), media_type=JSON)


ROUTES = [
    Route("/v1/embeddings", embeddings, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", get_model, methods=["GET"]),
]
