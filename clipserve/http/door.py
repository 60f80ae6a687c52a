"""The front-door interface: one API family's routes and its error shape.

A door is one module under http/doors/. Its inference routes are `inference_route`s: each makes
the door's `Call` (http/work.py) from the request before the body is read, and the pipeline runs
the rest, the same way for every door. Adding a protocol is one module and one entry in
`http/doors/__init__.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from clipserve.errors import UnsupportedMediaType
from clipserve.http.asgi import AsgiExchange, RequestHead, send_answer
from clipserve.http.pipeline import Pipeline
from clipserve.http.work import Call

CallFactory = Callable[[Request, Pipeline[Any]], Call[Any]]


class FrontDoor(Protocol):
    @property
    def error_prefixes(self) -> tuple[str, ...]:
        """Paths whose errors this door renders in its own shape ("" for every other path)."""
        ...

    def routes(self) -> Sequence[BaseRoute]: ...

    def render_error(self, status: int, code: str, message: str) -> Response:
        """A domain error as this API's clients expect it (status, code, message)."""
        ...


class InferenceEndpoint:
    """An inference route's ASGI app: the door's call from the request's head, the pipeline,
    the 200 answer. Errors are raised to the app's exception handlers (Starlette's, or the
    fast lane's lookup of the same ones). Reached through the router or the fast lane alike."""

    def __init__(self, make_call: CallFactory) -> None:
        self.make_call = make_call

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pipeline: Pipeline[Any] = scope["state"]["pipeline"]
        request = RequestHead(scope, receive)  # the head only: the exchange reads the body
        if "content-encoding" in request.headers:  # each of them: a second may say gzip
            for encoding in request.headers.getlist("content-encoding"):
                _identity(encoding)
        call = self.make_call(request, pipeline)  # 415, 404, 422... before the body is read
        exchange = AsgiExchange(scope, receive, request.headers)
        ctx, encoded = await pipeline.run(exchange, call)
        await send_answer(send, encoded, ctx.timer.header())


def _identity(encoding: str) -> None:
    """415 for a compressed body: no door decompresses, and one read as sent would be parsed as
    garbage (or, worse, happen to parse)."""
    if encoding.strip().lower() != "identity":
        raise UnsupportedMediaType(
            f"Content-Encoding {encoding[:40]} is not supported; send the request uncompressed"
        )


def inference_route(path: str, make_call: CallFactory) -> Route:
    """A POST route that runs the pipeline with the call `make_call` reads off the request."""
    return Route(path, InferenceEndpoint(make_call), methods=["POST"])
