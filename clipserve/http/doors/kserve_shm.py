"""Triton's system shared-memory extension over HTTP: register, status and unregister of the
regions `http/shm_regions.py` keeps (gRPC's SystemSharedMemory* methods call the same). CUDA
shared memory is answered as not supported (register) or empty (status, unregister), as
perf_analyzer calls those even in system mode."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import asdict

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from clipserve.errors import InvalidBody, PayloadTooLarge, Unsupported
from clipserve.http.asgi import AsgiExchange
from clipserve.http.pipeline import pipeline_of
from clipserve.http.request import declared_over, request_timeout, timed_out
from clipserve.protocol.media import JSON

SYSTEM = "/v2/systemsharedmemory"
CUDA = "/v2/cudasharedmemory"
MAX_REGISTER_BODY = 4096  # {"key", "offset", "byte_size"}
CUDA_UNSUPPORTED = "CUDA shared memory is not supported; use system shared memory"


def _name(request: Request) -> str | None:
    name: str | None = request.path_params.get("name")
    return name


def _too_large(declared: str | None = None) -> PayloadTooLarge:
    size = "body" if declared is None else f"body of {declared} bytes"
    return PayloadTooLarge(f"{size} exceeds {MAX_REGISTER_BODY}, a register request's most")


async def _body(request: Request, server_s: float) -> bytes:
    """The register request's small body, within the deadline of every body (--request-timeout-s,
    or a shorter X-Request-Timeout-Ms): a client that stalls mid-body gets a 408, as on /embed,
    and its connection closes (http/cycle.py's EarlyAnswerCycle), so it holds no connection."""
    declared = request.headers.get("content-length", "")
    if declared_over(declared, MAX_REGISTER_BODY):
        raise _too_large(declared if len(declared) <= 20 else f"{declared[:20]}...")
    timeout_s = request_timeout(request.headers, server_s)
    body = b""
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > MAX_REGISTER_BODY:
                    raise _too_large()
    except TimeoutError:
        raise timed_out(timeout_s, server_s, AsgiExchange.deadline_name, in_body=True) from None
    return body


async def register(request: Request) -> Response:
    pipeline = pipeline_of(request)
    body = await _body(request, pipeline.config.limits.request_timeout_s)
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise InvalidBody(f"malformed JSON ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("key"), str):
        raise InvalidBody('expected {"key": "/name", "offset": 0, "byte_size": N}')
    regions = pipeline.regions
    name = _name(request) or ""
    regions.register(name, doc["key"], doc.get("offset", 0), doc.get("byte_size"))
    return Response(status_code=200)


async def status(request: Request) -> Response:
    found = pipeline_of(request).regions.status(_name(request))
    return Response(orjson.dumps([asdict(r) for r in found]), media_type=JSON)


async def unregister(request: Request) -> Response:
    pipeline_of(request).regions.unregister(_name(request))
    return Response(status_code=200)


async def cuda_register(request: Request) -> Response:
    raise Unsupported(CUDA_UNSUPPORTED)


async def cuda_status(request: Request) -> Response:
    return Response(b"[]", media_type=JSON)


async def cuda_unregister(request: Request) -> Response:
    return Response(status_code=200)


def shared_memory_routes() -> Sequence[BaseRoute]:
    region = "/region/{name:path}"
    return [
        Route(SYSTEM + region + "/register", register, methods=["POST"]),
        Route(SYSTEM + region + "/status", status, methods=["GET"]),
        Route(SYSTEM + "/status", status, methods=["GET"]),
        Route(SYSTEM + region + "/unregister", unregister, methods=["POST"]),
        Route(SYSTEM + "/unregister", unregister, methods=["POST"]),
        Route(CUDA + region + "/register", cuda_register, methods=["POST"]),
        Route(CUDA + region + "/status", cuda_status, methods=["GET"]),
        Route(CUDA + "/status", cuda_status, methods=["GET"]),
        Route(CUDA + region + "/unregister", cuda_unregister, methods=["POST"]),
        Route(CUDA + "/unregister", cuda_unregister, methods=["POST"]),
    ]
