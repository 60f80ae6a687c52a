"""The outermost layer of every request: its id, its total time, its count, and the answers
no route gives (a bad request id, an unhandled error, a request cut off by the drain)."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import re
import secrets
import time
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from clipserve import errors
from clipserve.http.children import Children
from clipserve.http.status import ErrorPages
from clipserve.logs import ACCESS, log_access
from clipserve.metrics import Metrics

if TYPE_CHECKING:
    from clipserve.http.tracing import RequestTracing

log = logging.getLogger(__name__)
MAX_REQUEST_ID = 128
MAX_LOGGED_PATH = 1024  # a path may be as long as --max-header-bytes: an access line stays short

# "{name:path}" is labelled "{name}": the converter is how a route matches, not what it is.
_CONVERTER = re.compile(r"\{(\w+):\w+\}")


# Request ids made here: a random prefix per process and a counter. uuid4 read os.urandom per
# request, 7% of the event loop's time on small requests (bench/frontend/profile.py).
_ID_PREFIX = secrets.token_hex(6)
_ID_COUNTER = itertools.count()


def new_request_id() -> str:
    return f"{_ID_PREFIX}{next(_ID_COUNTER):08x}"


@functools.cache
def request_tracing(endpoint: str) -> RequestTracing | None:
    """--otel-endpoint's tracing, None when off: OpenTelemetry is imported only when on. One
    per process and endpoint: HTTP's spans and gRPC's leave through one exporter."""
    if not endpoint:
        return None
    from clipserve.http.tracing import RequestTracing

    return RequestTracing.otlp(endpoint)


def valid_request_id(raw: bytes) -> bool:
    """Visible ASCII only: it is echoed in a header and written to logs as it came."""
    return 0 < len(raw) <= MAX_REQUEST_ID and all(0x21 <= b <= 0x7E for b in raw)


class RequestObserver:
    """The outermost layer of every request: assigns or checks the request id, adds
    `X-Request-Id` and `Server-Timing` (with the total) to every answer, counts every response by
    route and status, and answers 503 `shutting_down` to requests the drain timeout cancels.
    Where on, it writes the access line (--log-format json) and the request's span with one
    child per stage (`tracing`: --otel-endpoint); off, each costs one test per request."""

    def __init__(
        self,
        app: ASGIApp,
        metrics: Metrics,
        pages: ErrorPages,
        tracing: RequestTracing | None = None,
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.pages = pages
        self.tracing = tracing
        self.deferred = metrics.deferred
        self.counted = Children(metrics.requests)
        self.timed = Children(metrics.request_duration)
        self.labels: dict[str, str] = {}  # a route's path -> its label
        self.answered: dict[tuple[str, int], tuple[Counter, Histogram]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        # The last one sent, as a dict of the headers kept it.
        sent_id = next((v for k, v in reversed(scope["headers"]) if k == b"x-request-id"), None)
        valid_id = sent_id is None or valid_request_id(sent_id)
        request_id = sent_id.decode("ascii") if sent_id and valid_id else new_request_id()
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        status, started = 500, False
        span = self.tracing.start(scope) if self.tracing is not None else None

        async def send_wrapper(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
                total = b"total;dur=%.3f" % ((time.perf_counter() - t0) * 1000)
                headers, timing = [], []
                for name, value in message.get("headers", ()):
                    if name == b"server-timing":  # the stages', joined with the total
                        timing.append(value)
                    else:
                        headers.append((name, value))
                timing.append(total)
                headers.append((b"x-request-id", request_id.encode()))
                headers.append((b"server-timing", b", ".join(timing)))
                message["headers"] = headers
            await send(message)

        async def answer(status: int, code: str, message: str, retry_after: int | None) -> None:
            response = self.pages.render(scope["path"], status, code, message, retry_after)
            await response(scope, receive, send_wrapper)

        try:
            if not valid_id:
                problem = f"X-Request-Id must be 1 to {MAX_REQUEST_ID} visible ASCII characters"
                await answer(400, errors.InvalidHeader.code, problem, None)
                return
            await self.app(scope, receive, send_wrapper)
        except Exception as exc:  # not a domain error: opaque 500, logged once with its id
            log.error("unhandled error, request id %s", request_id, exc_info=exc)
            if started:
                raise
            await answer(500, "internal", "internal error", None)
        except asyncio.CancelledError:
            # uvicorn cancels what is still running when --drain-timeout-s expires.
            if started:
                raise
            log.warning("request %s cancelled: drain timeout expired", request_id)
            problem = "server is shutting down; retry on another replica"
            await answer(503, errors.ShuttingDown.code, problem, errors.ShuttingDown.retry_after_s)
        finally:
            route = self._label(getattr(scope.get("route"), "path", "other"))
            elapsed = time.perf_counter() - t0
            children = self.answered.get((route, status))
            if children is None:  # routes and statuses are small sets: so is this table
                children = self.answered[route, status] = (
                    self.counted(route, str(status)),
                    self.timed(route),
                )
            with self.deferred as d:
                d.add_all(((children[0], 1.0),))
                d.observe_all(((children[1], elapsed),))
            if span is not None:
                span.finish(scope, route, status)
            if ACCESS.isEnabledFor(logging.INFO):
                _log_access(scope, state, request_id, route, status, elapsed)

    def _label(self, path: str) -> str:
        """The matched route's template (one label for /v2/models/{name}/infer), else other."""
        label = self.labels.get(path)
        if label is None:  # route paths are the app's few templates: a bounded table
            label = self.labels[path] = _CONVERTER.sub(r"{\1}", path)
        return label


def _log_access(
    scope: Scope, state: dict[str, Any], request_id: str, route: str, status: int, elapsed: float
) -> None:
    """One line per answered request. `items` and `key` are set by the layers that learn them
    (the pipeline once the body is parsed, the key check); absent, they are null."""
    client = scope.get("client")
    path = scope["path"][:MAX_LOGGED_PATH]
    peer = f"{client[0]}:{client[1]}" if client else None
    items, key = state.get("items"), state.get("key")
    log_access(request_id, scope["method"], route, path, status, elapsed, items, peer, key)
