"""What carries one request to the pipeline: an HTTP request (Starlette) here, a gRPC call in
`http/doors/kserve_grpc.py`. The pipeline walks both the same way (deadline, body within the
budget, admission, parse, batch, encode); an exchange says only how its transport gives the
deadline, the body and the client's going away.
"""

from __future__ import annotations

from typing import Protocol

from starlette.requests import Request

from clipserve.errors import PayloadTooLarge
from clipserve.http.cache_keys import reads_cache
from clipserve.http.request import BodyBudget, RequestContext, request_timeout, until_disconnected
from clipserve.http.timing import StageTimer


class Exchange(Protocol):
    @property
    def request_id(self) -> str: ...

    @property
    def timer(self) -> StageTimer:
        """The request's stage timer (error answers report the stages done too)."""
        ...

    @property
    def fresh(self) -> bool:
        """Cache-Control: no-cache (or its gRPC metadata): nothing read from the cache."""
        ...

    @property
    def deadline_name(self) -> str:
        """What set a deadline shorter than the server's, for the timeout's message."""
        ...

    def timeout_s(self, server_s: float) -> float:
        """The server's timeout, or the client's if shorter. InvalidHeader if malformed."""
        ...

    async def body(self, limit: int, budget: BodyBudget, ctx: RequestContext) -> bytes:
        """The whole body, within `limit` bytes, each byte reserved in `budget` (and counted
        in `ctx.reserved_bytes`, which the pipeline gives back)."""
        ...

    async def gone(self) -> None:
        """Returns when the client has gone away (its request's items then leave the queue)."""
        ...

    def note_items(self, n: int) -> None:
        """The parsed request's item count, for the access line."""
        ...


class HttpExchange:
    """A Starlette request: the deadline header, the streamed body, a disconnect."""

    deadline_name = "X-Request-Timeout-Ms"

    def __init__(self, request: Request) -> None:
        self.request = request
        self.request_id: str = request.state.request_id
        self.timer = request.state.timer = StageTimer()

    @property
    def fresh(self) -> bool:
        return not reads_cache(self.request.headers)

    def timeout_s(self, server_s: float) -> float:
        return request_timeout(self.request.headers, server_s)

    async def body(self, limit: int, budget: BodyBudget, ctx: RequestContext) -> bytes:
        declared = self.request.headers.get("content-length")
        digits = declared is not None and declared.isascii() and declared.isdigit()
        if declared is not None and digits and (len(declared) > 19 or int(declared) > limit):
            raise PayloadTooLarge(
                f"body of {declared[:20]} bytes exceeds {limit} (--max-body-bytes)"
            )
        # Reserved as bytes arrive, not as declared: a client that declares a large body and
        # stalls holds only what it sent (headers alone must not lock uploads out).
        chunks, size = [], 0
        async for chunk in self.request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"body exceeds {limit} bytes (--max-body-bytes)")
            budget.reserve(len(chunk))
            ctx.reserved_bytes += len(chunk)
            chunks.append(chunk)
        return b"".join(chunks)

    async def gone(self) -> None:
        await until_disconnected(self.request.receive)

    def note_items(self, n: int) -> None:
        self.request.state.items = n
