"""Domain errors to HTTP: one status per error class, rendered in the shape of the front door
that owns the path; Starlette's own 404/405 and a client gone mid-request likewise."""

from __future__ import annotations

from collections.abc import Sequence

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from clipserve import errors
from clipserve.http.door import FrontDoor
from clipserve.protocol.responses import encode_error

STATUS: dict[type[errors.ClipserveError], int] = {
    errors.InvalidImage: 400,
    errors.InvalidTensor: 400,
    errors.InvalidBody: 400,
    errors.InvalidText: 400,
    errors.TextTooLong: 413,
    errors.TooManyTexts: 413,
    errors.PayloadTooLarge: 413,
    errors.ImageTooLarge: 413,
    errors.TooManyItems: 413,
    errors.UnsupportedMediaType: 415,
    errors.NotAcceptable: 406,
    errors.Unsupported: 400,
    errors.InvalidParameter: 422,
    errors.ModelNotFound: 404,
    errors.Unauthorized: 401,
    errors.RateLimited: 429,
    errors.Overloaded: 503,
    errors.NotReady: 503,
    errors.InvalidHeader: 400,
    errors.RequestTimeout: 504,
    errors.BodyTimeout: 408,
    errors.ExecutorFailed: 500,
    errors.NonFiniteEmbedding: 422,
}
CLIENT_CLOSED = 499  # nginx's code for "client closed request"; nobody reads the body
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


def status_for(error: errors.ClipserveError) -> int:
    for cls in type(error).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500


def native_error(status: int, code: str, message: str) -> Response:
    return Response(encode_error(code, message), status, media_type="application/json")


class ErrorPages:
    """Error answers for every path, each in the shape of the door that owns it."""

    def __init__(self, doors: Sequence[FrontDoor]) -> None:
        # Longest prefix first, so a door's own paths win over a catch-all ("").
        pairs = [(prefix, door) for door in doors for prefix in door.error_prefixes]
        self._by_prefix = sorted(pairs, key=lambda pair: -len(pair[0]))

    def render(
        self, path: str, status: int, code: str, message: str, retry_after: int | None = None
    ) -> Response:
        door = next((d for prefix, d in self._by_prefix if path.startswith(prefix)), None)
        render = door.render_error if door is not None else native_error
        response = render(status, code, message)
        if retry_after is not None:
            response.headers["Retry-After"] = str(retry_after)
        return response

    async def domain_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, errors.ClipserveError)
        status = status_for(exc)
        message = "internal error" if status == 500 else exc.message  # 500s stay opaque
        retry_after = getattr(exc, "retry_after_s", None)
        response = self.render(request.url.path, status, exc.code, message, retry_after)
        timer = getattr(request.state, "timer", None)
        if timer is not None and timer.stages:
            response.headers["Server-Timing"] = timer.header()
        return response

    async def http_error(self, request: Request, exc: Exception) -> Response:
        """Starlette's own 404/405 (no route, wrong method) in the same shape as the rest."""
        assert isinstance(exc, HTTPException)
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        message = f"{request.method} {request.url.path[:200]}: {exc.detail}"
        response = self.render(request.url.path, exc.status_code, code, message)
        response.headers.update(exc.headers or {})  # 405 carries Allow
        return response

    async def client_gone(self, request: Request, exc: Exception) -> Response:
        return native_error(CLIENT_CLOSED, "client_closed", "client closed the request")
