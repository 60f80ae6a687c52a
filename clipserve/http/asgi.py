"""An HTTP request as the pipeline reads it, straight from ASGI messages, and its 200 answer
written back the same way: no Request stream, no Response object, one header list.

Every inference route goes through here, from Starlette's router or from the fast lane
(http/fastlane.py) alike; the contracts are the pipeline's and the middleware's either way.
"""

from __future__ import annotations

from typing import Any

from starlette.datastructures import Headers, QueryParams
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from clipserve.errors import PayloadTooLarge
from clipserve.http.cache_keys import reads_cache
from clipserve.http.request import (
    WATCH_SCOPE_KEY,
    BodyBudget,
    ClientGone,
    DisconnectWatch,
    RequestContext,
    declared_over,
    request_timeout,
)
from clipserve.http.timing import StageTimer
from clipserve.http.work import Encoded


class HeaderMap(Headers):
    """Starlette's `Headers`, looked up in a dict built once: `Headers` scans and decodes the
    whole list on every lookup, and a missing header raises inside `get`. The first of
    repeated headers wins, as there; uvicorn hands the names lower-cased. Two lookups answer
    where `Headers` raises: a name outside latin-1 is absent, and a key that is no string is
    not in it."""

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        super().__init__(raw=raw)
        # Raw bytes, decoded as looked up: a request reads a handful of its headers, and a
        # dict built by `dict` costs one call where decoding every name and value cost two each.
        self._map = dict(reversed(raw))

    def __getitem__(self, key: str) -> str:
        value: str | None = self.get(key)
        if value is None:
            raise KeyError(key)
        return value

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.get(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        try:
            raw = self._map.get(key.lower().encode("latin-1"))
        except UnicodeEncodeError:  # no header name has such a character
            return default
        return default if raw is None else raw.decode("latin-1")


_NO_QUERY = QueryParams(b"")


class RequestHead(Request):
    """What a door's call factory reads of a request (path, query, headers), cheaply: the
    headers as a `HeaderMap`, an empty query string not parsed at all."""

    def __init__(self, scope: Scope, receive: Receive) -> None:
        super().__init__(scope, receive)
        self._head = HeaderMap(scope["headers"])

    @property
    def headers(self) -> Headers:
        return self._head

    @property
    def query_params(self) -> QueryParams:
        return super().query_params if self.scope["query_string"] else _NO_QUERY


class AsgiExchange:
    """One HTTP request: the deadline header, the body from `receive`, a disconnect. Sets the
    request's stage timer and item count in the scope's state, where the error pages, the
    access line and the span read them."""

    deadline_name = "X-Request-Timeout-Ms"

    def __init__(self, scope: Scope, receive: Receive, headers: Headers) -> None:
        self.receive = receive
        self.headers = headers
        self.state: dict[str, Any] = scope["state"]
        self.request_id: str = self.state["request_id"]  # the observer's
        self.timer = StageTimer()
        self.state["timer"] = self.timer
        # The connection's disconnect signal, where the server gives one (http/server.py).
        self.watch: DisconnectWatch | None = scope.get(WATCH_SCOPE_KEY)

    @property
    def fresh(self) -> bool:
        if self.headers.get("cache-control") is None:  # one lookup: most requests send none
            return False
        return not reads_cache(self.headers.getlist("cache-control"))

    def timeout_s(self, server_s: float) -> float:
        return request_timeout(self.headers, server_s)

    async def body(self, limit: int, budget: BodyBudget, ctx: RequestContext) -> bytes:
        declared = self.headers.get("content-length")
        if declared is not None and declared_over(declared, limit):
            raise PayloadTooLarge(
                f"body of {declared[:20]} bytes exceeds {limit} (--max-body-bytes)"
            )
        # Reserved as bytes arrive, not as declared: a client that declares a large body and
        # stalls holds only what it sent (headers alone must not lock uploads out).
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            message = await self.receive()
            if message["type"] != "http.request":  # http.disconnect
                raise ClientGone()
            chunk: bytes = message.get("body", b"")
            more = message.get("more_body", False)
            if not chunk:
                continue
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"body exceeds {limit} bytes (--max-body-bytes)")
            budget.reserve(len(chunk))
            ctx.reserved_bytes += len(chunk)
            chunks.append(chunk)
        ctx.watch = self.watch  # the body is read: from here on, a disconnect is all it says
        # One chunk, the usual case once uvicorn has gathered the body: used as it came.
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def gone(self) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass

    def note_items(self, n: int) -> None:
        self.state["items"] = n


def _media(media_type: str) -> bytes:
    """Content-Type as Starlette's Response writes it: text types get their charset."""
    if media_type.startswith("text/") and "charset=" not in media_type.lower():
        media_type += "; charset=utf-8"
    return media_type.encode("latin-1")


async def send_answer(send: Send, encoded: Encoded, timing: str) -> None:
    """The 200 answer: body, media type, the door's headers and the stages' Server-Timing."""
    headers = [
        (b"content-length", b"%d" % len(encoded.content)),
        (b"content-type", _media(encoded.media_type)),
        *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in encoded.headers.items()),
        (b"server-timing", timing.encode("latin-1")),
    ]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": encoded.content})
