"""One request's own state while the pipeline runs it: its deadline, its timer, its share of
the body budget, and a watch on its connection."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from starlette.types import Receive

from clipserve.errors import InvalidHeader, Overloaded
from clipserve.http.timing import StageTimer

T = TypeVar("T")
DEADLINE_HEADER = "x-request-timeout-ms"


@dataclass
class RequestContext:
    """What the pipeline knows about one request while it runs."""

    request_id: str
    timer: StageTimer
    deadline: float  # time.perf_counter() by which the answer must be ready
    gone: Callable[[], Awaitable[None]]  # returns once the client has gone away
    body_bytes: int = 0
    reserved_bytes: int = 0  # share of --max-body-bytes-in-flight held until the request ends


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class BodyBudget:
    """Bytes of request bodies held in memory across all requests of this process; past it,
    503 overloaded. With --workers N, `SharedBodyBudget` (http/body_budget.py) spans them all."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0

    def reserve(self, n: int) -> None:
        if self.used + n > self.capacity:
            raise Overloaded(
                f"request bodies in memory would exceed {self.capacity} bytes "
                "(--max-body-bytes-in-flight); retry later"
            )
        self.used += n

    def release(self, n: int) -> None:
        self.used -= n

    def close(self) -> None:
        """Nothing to free here; a shared budget unmaps its table."""


async def until_disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_gone(gone: Callable[[], Awaitable[None]], work: Awaitable[T]) -> T:
    """Await `work` in this task, cancelling it if the client goes away first (its items leave
    the queue): ClientGone then. One watcher task per request; the work runs in the caller's."""
    task = asyncio.current_task()
    assert task is not None
    left = False

    def leave(watcher: asyncio.Future[None]) -> None:
        nonlocal left
        if not watcher.cancelled() and watcher.exception() is None:
            left = True
            task.cancel()

    watcher = asyncio.ensure_future(gone())
    watcher.add_done_callback(leave)
    try:
        result = await work
    except asyncio.CancelledError:
        if not left:  # the deadline's, or the server's drain: theirs to handle
            raise
        task.uncancel()  # ours, taken back
        raise ClientGone() from None
    finally:
        watcher.remove_done_callback(leave)
        watcher.cancel()
    if left:  # the work finished despite our cancellation: the client is gone all the same
        task.uncancel()
        raise ClientGone()
    return result


def request_timeout(headers: Mapping[str, str], server_timeout_s: float) -> float:
    """The server's timeout, shortened by the client's `X-Request-Timeout-Ms` if it sent one."""
    raw = headers.get(DEADLINE_HEADER)
    if raw is None:
        return server_timeout_s
    try:
        ms = float(raw)
    except ValueError:
        ms = float("nan")
    if not ms > 0 or ms == float("inf"):
        raise InvalidHeader(f"X-Request-Timeout-Ms: expected a positive number, got {raw[:40]!r}")
    return min(ms / 1000, server_timeout_s)
