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

from clipserve.http.pipeline import Pipeline, pipeline_of
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


def inference_route(path: str, make_call: CallFactory) -> Route:
    """A POST route that runs the pipeline with the call `make_call` reads off the request."""

    async def endpoint(request: Request) -> Response:
        pipeline = pipeline_of(request)
        return await pipeline.serve(request, make_call(request, pipeline))

    return Route(path, endpoint, methods=["POST"])
