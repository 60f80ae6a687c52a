"""The paths other embedding servers answer on, always on, so their clients need no changes:
Infinity's un-prefixed OpenAI routes and health, and NVIDIA NIM's health and metrics.

Always on rather than behind a flag: they cost one route each, shadow nothing of clipserve's
own, and a flag would be one more thing a migrating team has to find. Each answers as the
route it aliases does (same handler, same error shape), except the health bodies, which take
the shape their server's clients read.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from clipserve.http import health
from clipserve.http.door import inference_route
from clipserve.http.doors import native, openai
from clipserve.http.pipeline import pipeline_of

INFINITY = ("/embeddings", "/models")  # OpenAI's routes without /v1


async def infinity_health(request: Request) -> Response:
    """Infinity's `GET /health`: `{"unix": <time>}` while ready; 503 otherwise."""
    ready = pipeline_of(request).readiness().ok
    body = {"unix": time.time()} if ready else {"unix": time.time(), "ready": False}
    return JSONResponse(body, status_code=200 if ready else 503)


def _nim_health(ok: bool, message: str) -> Response:
    body = {"object": "health.response", "message": message}
    return JSONResponse(body, status_code=200 if ok else 503)


async def nim_ready(request: Request) -> Response:
    """NIM's `GET /v1/health/ready`, as /readyz decides it."""
    ok = pipeline_of(request).readiness().ok
    return _nim_health(ok, "Service is ready." if ok else "Service is not ready.")


async def nim_live(request: Request) -> Response:
    """NIM's `GET /v1/health/live`, as /healthz decides it."""
    live = health.liveness(pipeline_of(request).towers)
    return _nim_health(live.ok, "Service is live." if live.ok else live.reason)


class AliasDoor:
    """Errors on Infinity's paths come in OpenAI's shape, as they do on Infinity."""

    error_prefixes = INFINITY

    def routes(self) -> Sequence[BaseRoute]:
        return [
            inference_route("/embeddings", openai.Embeddings.of),
            Route("/models", openai.list_models, methods=["GET"]),
            Route("/models/{model:path}", openai.get_model, methods=["GET"]),
            Route("/health", infinity_health, methods=["GET"]),
            Route("/v1/health/ready", nim_ready, methods=["GET"]),
            Route("/v1/health/live", nim_live, methods=["GET"]),
            Route("/v1/metrics", native.metrics, methods=["GET"]),
        ]

    def render_error(self, status: int, code: str, message: str) -> Response:
        return openai.OpenAIDoor().render_error(status, code, message)
