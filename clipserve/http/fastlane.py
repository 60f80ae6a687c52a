"""The fast lane: inference POSTs go straight from the request observer and the key check to
their route's endpoint, past Starlette's exception middleware, router and request/response
wrappers (on one core, those layers cost as much as the work of a small request).

It routes exactly as the router does: the first route in the router's order that fully matches
the path and method, and only when that route's app is an `InferenceEndpoint`; anything else
(another route, a 405, a 404, a redirect) goes on to Starlette unchanged. Errors raised by the
endpoint are rendered by the app's own exception handlers, looked up by class as Starlette's
exception middleware does. The endpoint and the pipeline are the ones the router would run.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, cast

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from clipserve.http.door import InferenceEndpoint

Handler = Callable[[Request, Exception], Awaitable[Response]]


def _fast(route: BaseRoute) -> bool:
    return isinstance(route, Route) and isinstance(route.app, InferenceEndpoint)


def first_match(routes: Sequence[BaseRoute], scope: Scope) -> tuple[BaseRoute, Scope] | None:
    """The route Starlette's router would pick for `scope`, with its child scope; None if it
    would answer 404 or 405 (no full match)."""
    for route in routes:
        match, child = route.matches(scope)
        if match is Match.FULL:
            return route, child
    return None


SEEN_PATHS = 256  # parameterised paths whose route is kept (a deployment names a few models)
SEEN_PATH_CHARS = 256  # the longest kept
_UNSEEN = object()


class InferenceRoutes:
    """Which inference endpoint the router would send a POST to, if any: paths without
    parameters from a dict, the others by the router's own matching, once per path (the
    regexes of ~40 routes cost 14-26 us a KServe request, paid by the fast lane and the key
    check alike)."""

    def __init__(self, routes: Sequence[BaseRoute]) -> None:
        self.routes = list(routes)
        # Paths without parameters: resolved once (the router's answer cannot change).
        self.exact: dict[str, Route] = {}
        # Paths with parameters: (literal start, literal end) of each, a cheap first filter.
        self.shapes: list[tuple[str, str]] = []
        self._seen: dict[str, tuple[Route, dict[str, Any]] | None] = {}
        for route in self.routes:
            if not _fast(route):
                continue
            assert isinstance(route, Route)
            if not route.param_convertors:
                probe = {"type": "http", "path": route.path, "method": "POST"}
                found = first_match(self.routes, probe)
                if found is not None and found[0] is route:
                    self.exact[route.path] = route
            else:
                self.shapes.append((route.path.partition("{")[0], route.path.rpartition("}")[2]))

    def find(self, scope: Scope) -> tuple[Route, Scope] | None:
        """For a POST: its inference route and the child scope the router would give it."""
        if scope.get("root_path"):  # its path holds the prefix: the router's own matching
            return self._match(scope)
        path: str = scope["path"]
        exact = self.exact.get(path)
        if exact is not None:
            return exact, {"endpoint": exact.endpoint, "path_params": {}}
        if not any(path.startswith(a) and path.endswith(b) for a, b in self.shapes):
            return None
        seen = self._seen.get(path, _UNSEEN)
        if seen is _UNSEEN:
            found = self._match(scope)
            seen = None if found is None else (found[0], found[1]["path_params"])
            if len(path) > SEEN_PATH_CHARS:  # not kept: a client's megabyte of path
                return found
            if len(self._seen) >= SEEN_PATHS:  # bounded: a client inventing paths
                self._seen.clear()
            self._seen[path] = seen
        if seen is None:
            return None
        route, params = cast("tuple[Route, dict[str, Any]]", seen)
        return route, {"endpoint": route.endpoint, "path_params": dict(params)}

    def _match(self, scope: Scope) -> tuple[Route, Scope] | None:
        found = first_match(self.routes, scope)
        if found is None or not _fast(found[0]):
            return None
        route, child = found
        assert isinstance(route, Route)
        return route, child


class FastLane:
    """ASGI middleware over Starlette's stack, inside the observer and the key check."""

    def __init__(
        self,
        app: ASGIApp,
        routes: InferenceRoutes,
        handlers: Mapping[type[Exception], Handler],
    ) -> None:
        self.app = app
        self.routes = routes
        self.handlers = dict(handlers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            found = self.routes.find(scope)
            if found is not None:
                await self._serve(found[0], found[1], scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _serve(
        self, route: Route, child: Scope, scope: Scope, receive: Receive, send: Send
    ) -> None:
        scope["route"] = route  # as the router sets them: the observer labels by the route
        scope.update(child)
        try:
            await route.app(scope, receive, send)
        except Exception as exc:
            # The endpoint sends nothing before its answer is ready: an error is unanswered yet.
            handler = self._handler(exc)
            if handler is None:
                raise  # to the observer: an opaque 500
            response = await handler(Request(scope, receive), exc)
            await response(scope, receive, send)

    def _handler(self, exc: Exception) -> Handler | None:
        for cls in type(exc).__mro__:
            if cls in self.handlers:
                return self.handlers[cls]
        return None
