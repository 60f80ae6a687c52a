"""One request's own state while the pipeline runs it: its deadline, its timer, its share of
the body budget, and a watch on its connection."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import TypeVar

from clipserve.errors import BodyTimeout, InvalidHeader, Overloaded, RequestTimeout
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
    body_read: bool = False  # the whole body has arrived: a deadline passing now is a 504
    reserved_bytes: int = 0  # share of --max-body-bytes-in-flight held until the request ends
    # The connection's own disconnect signal where the server gives one (uvicorn through
    # GuardedHttpProtocol): the wait for the answer then needs no watcher task.
    watch: DisconnectWatch | None = None


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


WATCH_SCOPE_KEY = "clipserve.disconnect"  # where the server puts a connection's watch


class DisconnectWatch:
    """One connection's going away, as its protocol learns of it (`connection_lost`): the
    callbacks of the waits on it, if any, run then. One request runs at a time on a
    connection (uvicorn queues pipelined ones); a request waits on both towers at once in
    two tasks, so the callbacks are a list, not a slot."""

    __slots__ = ("callbacks", "gone", "listen")

    def __init__(self) -> None:
        self.gone = False
        self.callbacks: list[Callable[[], None]] = []
        # The protocol's resume_reading: uvicorn stops reading while a body past 64 KiB waits
        # to be taken, and a socket not read never reports its close. (A watcher awaiting
        # `receive()` resumed it the same way.)
        self.listen: Callable[[], None] = lambda: None

    def lost(self) -> None:
        """Called by the protocol once the connection is closed."""
        self.gone = True
        callbacks, self.callbacks = self.callbacks, []
        for callback in callbacks:
            callback()


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


async def unless_gone(
    gone: Callable[[], Awaitable[None]], work: Awaitable[T], watch: DisconnectWatch | None = None
) -> T:
    """Await `work` in this task, cancelling it if the client goes away first (its items leave
    the queue): ClientGone then. With the connection's `watch`, its callback cancels; else one
    watcher task awaits `gone()`. The work runs in the caller's task either way."""
    task = asyncio.current_task()
    assert task is not None
    left = False

    def leave() -> None:
        nonlocal left
        left = True
        task.cancel()

    stop: Callable[[], None]
    if watch is not None:
        if watch.gone:  # gone already: the work never starts (nothing of it was queued)
            if isinstance(work, Coroutine):
                work.close()
            raise ClientGone()
        watch.listen()  # the body is read: hear the close even if reading was paused
        watch.callbacks.append(leave)

        def stop() -> None:
            if not left:
                watch.callbacks.remove(leave)
    else:

        def on_watcher(watcher: asyncio.Future[None]) -> None:
            if not watcher.cancelled() and watcher.exception() is None:
                leave()

        watcher = asyncio.ensure_future(gone())
        watcher.add_done_callback(on_watcher)

        def stop() -> None:
            watcher.remove_done_callback(on_watcher)
            watcher.cancel()

    try:
        result = await work
    except asyncio.CancelledError:
        if not left:  # the deadline's, or the server's drain: theirs to handle
            raise
        task.uncancel()  # ours, taken back
        raise ClientGone() from None
    finally:
        stop()
    if left:  # the work finished despite our cancellation: the client is gone all the same
        task.uncancel()
        raise ClientGone()
    return result


def timed_out(
    timeout_s: float, server_s: float, deadline_name: str, *, in_body: bool = False
) -> RequestTimeout:
    """The error of a request past its deadline, naming the limit that set it: the client's
    own (`deadline_name`: its header, or gRPC's deadline) where shorter than the server's.
    `in_body`: it passed while the body was still arriving, a `BodyTimeout` (408)."""
    limit = deadline_name if timeout_s < server_s else "--request-timeout-s"
    if in_body:
        return BodyTimeout(f"request body not received within {timeout_s:g} s ({limit})")
    return RequestTimeout(f"request took longer than {timeout_s:g} s ({limit})")


def declared_over(declared: str, limit: int) -> bool:
    """Whether a Content-Length value declares more than `limit` bytes (the length first:
    int() refuses strings of over 4300 digits). A value that is not digits is the parser's."""
    if not (declared.isascii() and declared.isdigit()):
        return False
    return len(declared) > 19 or int(declared) > limit


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
