"""What carries one request to the pipeline: an HTTP request (`AsgiExchange` in `http/asgi.py`)
or a gRPC call (`http/doors/kserve_grpc.py`). The pipeline walks both the same way (deadline,
body within the budget, admission, parse, batch, encode); an exchange says only how its
transport gives the deadline, the body and the client's going away.
"""

from __future__ import annotations

from typing import Protocol

from clipserve.http.request import BodyBudget, RequestContext
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
