"""Work items, admission control and the queue batches are formed from.

Everything here runs on the event loop; nothing blocks. Putting and taking cost O(1) per item
whatever the queue's length (`batching/lane.py`), and a request's items are answered into one
array with one future for the request (`Gathering`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from clipserve.batching.lane import Lane, StackKey
from clipserve.errors import Overloaded, RequestTimeout

RECHECK_S = 0.002


def is_encoded(array: np.ndarray) -> bool:
    """An image still encoded (`--decode gpu`: a JPEG's bytes); crops are (H, W, 3), tensors
    (3, H, W), token rows are int64."""
    return array.ndim == 1 and array.dtype == np.uint8


class Admission:
    """Counts items admitted and not yet computing, so decode backlog and queue stay bounded.
    `items` names them in the refusal (a text tower's are texts)."""

    def __init__(self, capacity: int, items: str = "images") -> None:
        self.capacity = capacity
        self.used = 0
        self.items = items

    def fits(self, n: int) -> bool:
        return self.used + n <= self.capacity

    def full(self, retry_after_s: int = 1) -> Overloaded:
        return Overloaded(
            f"server queue is full ({self.used} of {self.capacity} {self.items} admitted, queued "
            "or in requests being read); retry later",
            retry_after_s,
        )

    def admit(self, n: int, deadline: float | None = None) -> Ticket:
        if not self.fits(n):
            raise self.full()
        self.used += n
        return Ticket(self, n, deadline)


@dataclass(eq=False, slots=True)
class Ticket:
    """One request's share of the admission budget; released image by image as they start."""

    admission: Admission
    held: int
    deadline: float | None = None  # time.perf_counter() by which the request must be answered

    def release(self, n: int = 1) -> None:
        n = min(n, self.held)
        self.held -= n
        self.admission.used -= n

    def release_all(self) -> None:
        self.release(self.held)

    def split(self, n: int = 1) -> Ticket:
        """Up to n of these places as a ticket of their own: an item that several requests may
        wait on holds its place apart from any one of them (`batching/cache.py`)."""
        n = min(n, self.held)
        self.held -= n
        return Ticket(self.admission, n, self.deadline)

    def absorb(self, other: Ticket) -> None:
        """Take over `other`'s places (a request that turned out bigger once parsed)."""
        assert other.admission is self.admission
        self.held += other.held
        other.held = 0


@dataclass(eq=False, slots=True)
class WorkItem:
    array: np.ndarray  # uint8 HWC, or normalised float CHW
    normalize: bool
    request_id: str
    # Its own future where other requests may wait on it (a keyed item: `batching/cache.py`);
    # else its request's (`gathering.future`): one future per request, done once the request
    # is answered, failed or gone, which is when its items stop mattering.
    future: asyncio.Future[Any]
    ticket: Ticket
    enqueued_at: float  # time.perf_counter()
    # time.perf_counter(); past it the item is dropped unstarted. It only ever moves later
    # (`batching/cache.py` extends it for a second waiter), which the queue's heaps rely on.
    deadline: float | None = None
    gathering: Gathering | None = None  # the request that made it, told when it is answered
    index: int = 0  # its place in that request
    started_at: float = 0.0
    finished_at: float = 0.0
    seq: int = 0  # arrival order in its queue
    lane: Lane[WorkItem] | None = None  # where it waits; None once taken, dropped or never queued


class Gathering:
    """One request's rows, written in place as its items are answered (`resolve`), and one
    future for the whole request: no future, callback or task per item on the way back."""

    __slots__ = ("failed", "future", "pending", "rows")

    def __init__(self, future: asyncio.Future[None], n: int) -> None:
        self.future = future
        self.rows: np.ndarray | None = None  # (n, D), made when the first row lands
        self.pending = n
        self.failed = -1  # the index of the item whose error ended the request

    def landed(self, index: int, result: np.ndarray | BaseException) -> None:
        if self.future.done():
            return
        if isinstance(result, BaseException):
            self.failed = index
            self.future.set_exception(result)
            return
        rows = self.rows
        if rows is None:
            rows = self.rows = np.empty((self.pending, *result.shape), np.float32)
        rows[index] = result
        self.pending -= 1
        if not self.pending:
            self.future.set_result(None)

    def landed_block(self, start: int, block: np.ndarray) -> None:
        """Rows start.. of the request, all computed (`DeviceWorker._settle`)."""
        if self.future.done():
            return
        n = len(block)
        rows = self.rows
        if rows is None and n == self.pending:  # the whole request in one batch: one copy
            self.rows = block.astype(np.float32)  # (a copy: the block is the executor's)
        else:
            if rows is None:
                rows = self.rows = np.empty((self.pending, *block.shape[1:]), np.float32)
            rows[start : start + n] = block
        self.pending -= n
        if not self.pending:
            self.future.set_result(None)

    def joined(self, index: int, future: asyncio.Future[np.ndarray]) -> None:
        """A done callback: an item another request made (`batching/cache.py`'s flights)."""
        if not future.cancelled():
            exc = future.exception()
            self.landed(index, future.result() if exc is None else exc)


def resolve(item: WorkItem, result: np.ndarray | BaseException) -> None:
    """Answer an item, once: its request, and its own future where it has one (read by the
    cache and by the requests that joined it)."""
    future = item.future
    if future.done():  # answered, or its request is over (failed, timed out, gone)
        return
    gathering = item.gathering
    if gathering is None:
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)
        return
    if future is not gathering.future:  # an item of its own (keyed): others may wait on it
        if isinstance(result, BaseException):
            future.set_exception(result)
            future.exception()  # retrieved: its request raises it
        else:
            future.set_result(result)
        if gathering.future.done():
            return
    if isinstance(result, BaseException):
        gathering.failed = item.index
        gathering.future.set_exception(result)
        return
    rows = gathering.rows  # Gathering.landed, inlined: this runs for every image
    if rows is None:
        rows = gathering.rows = np.empty((gathering.pending, *result.shape), np.float32)
    rows[item.index] = result
    gathering.pending -= 1
    if not gathering.pending:
        gathering.future.set_result(None)


_ENCODED: StackKey = ("encoded", ())
_UINT8 = np.dtype(np.uint8)


def _stack_key(array: np.ndarray) -> StackKey:
    """Items with equal keys can be stacked into one batch: one dtype and shape. Encoded
    images of any length batch together (the device worker decodes them into crops first)."""
    if array.ndim == 1 and array.dtype == _UINT8:
        return _ENCODED
    return (array.dtype.str, array.shape)


def _no_cost(n: int) -> float:
    return 0.0


class BatchQueue:
    """The work items shared by every device worker of one model, in one lane per stack key.
    Taking a batch costs O(batch + items dropped), never O(queue)."""

    def __init__(
        self,
        on_expired: Callable[[int], None] = lambda n: None,
        admitted: Callable[[], int] = lambda: 0,
    ) -> None:
        self._lanes: dict[StackKey, Lane[WorkItem]] = {}
        self._live = 0
        self._seq = 0  # arrival order across lanes: the oldest item's lane goes first
        self._waiters: list[asyncio.Future[None]] = []  # takers waiting for a put
        self.on_expired = on_expired  # told how many items were dropped for their deadline
        # Images admitted and not started: those queued here, and those still decoding.
        self.admitted = admitted

    def __len__(self) -> int:
        return self._live

    async def put(self, items: Iterable[WorkItem]) -> None:
        self.put_nowait(items)

    def put_nowait(self, items: Iterable[WorkItem]) -> None:
        run: list[WorkItem] = []  # consecutive items of one key: one lane's share
        key: StackKey | None = None
        dtype: np.dtype[Any] | None = None
        shape: tuple[int, ...] = ()
        for item in items:
            array = item.array
            # A request's arrays share a dtype and shape: its key is made once.
            if array.dtype is not dtype or array.shape != shape:
                k = _stack_key(array)
                if k != key and run:
                    self._extend(key, run)
                    run = []
                key, dtype, shape = k, array.dtype, array.shape
            run.append(item)
        if run:
            self._extend(key, run)
            self._wake()

    def _extend(self, key: StackKey | None, items: list[WorkItem]) -> None:
        assert key is not None
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = Lane(key)
        self._seq = lane.extend(items, self._seq)
        self._live += len(items)

    def discard(self, items: Iterable[WorkItem]) -> None:
        """Drop items that have not started (their request timed out, failed or went away)."""
        touched: dict[int, Lane[WorkItem]] = {}
        for item in items:
            lane = item.lane
            if lane is not None:
                lane.remove(item)
                self._live -= 1
                touched[id(lane)] = lane
        for lane in touched.values():
            self._tidy(lane)

    def fail_all(self, error: Exception) -> None:
        lanes, self._lanes, self._live = self._lanes, {}, 0
        for lane in lanes.values():
            for item in list(lane):
                item.lane = None
                item.ticket.release(1)  # a cached item's own ticket: its requests do not
                resolve(item, error)

    def _tidy(self, lane: Lane[WorkItem]) -> None:
        if lane.live == 0:
            if self._lanes.get(lane.key) is lane:
                del self._lanes[lane.key]
        else:
            lane.compact()

    def _oldest(self) -> tuple[Lane[WorkItem], WorkItem] | None:
        best: tuple[Lane[WorkItem], WorkItem] | None = None
        for lane in self._lanes.values():  # few: one per input kind and shape
            head = lane.head()
            if head is not None and (best is None or head.seq < best[1].seq):
                best = (lane, head)
        return best

    def _expire(self, items: list[WorkItem], why: str) -> None:
        for item in items:
            item.ticket.release(1)
            resolve(item, RequestTimeout(why))
        if items:
            self.on_expired(len(items))

    def _pop(self, max_n: int, batch_seconds: Callable[[int], float]) -> list[WorkItem]:
        """Up to max_n live items that stack with the oldest one, in arrival order.

        Items whose deadline has passed are dropped. So are items that would finish after their
        deadline if started now (by `batch_seconds`, the worker's estimate for the batch this
        will be), but only when other live items can run instead: an idle device computes even
        a doomed item, which keeps its cost estimate measured rather than stuck at a value that
        refuses everything.
        """
        now = time.perf_counter()
        passed: list[WorkItem] = []
        for lane in list(self._lanes.values()):
            passed += lane.due(now, inclusive=True)
            self._tidy(lane)
        self._live -= len(passed)
        self._expire(passed, "deadline passed while the request was queued")
        oldest = self._oldest()
        if oldest is None:
            return []
        lane = oldest[0]
        finish_by = now + batch_seconds(min(max_n, lane.live))
        doomed = lane.due(finish_by, inclusive=False)
        if lane.live:
            batch, gone = lane.take(max_n)
            self._live -= len(doomed) + gone
            self._expire(doomed, "deadline too close to compute the request in time")
        else:  # nothing else can run: the oldest doomed items do, the rest stay queued
            doomed.sort(key=_arrival)
            batch = doomed[:max_n]
            lane.requeue(doomed[max_n:])
            self._live -= len(batch)
        self._tidy(lane)
        return batch

    def _full_or_none_coming(self, max_n: int) -> bool:
        """Whether the batch is full, or no admitted image is still on its way (being parsed or
        decoded: admitted and not queued)."""
        live = self._live
        return live >= max_n or self.admitted() <= live

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def _wait(self, timeout_s: float | None) -> None:
        """Until the next put, or `timeout_s`."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters.append(waiter)
        timer = None if timeout_s is None else loop.call_later(timeout_s, _wake_one, waiter)
        try:
            await waiter
        finally:
            if timer is not None:
                timer.cancel()
            with contextlib.suppress(ValueError):  # gone already if a put woke it
                self._waiters.remove(waiter)

    async def take(
        self, max_n: int, max_delay_s: float, batch_seconds: Callable[[int], float] = _no_cost
    ) -> list[WorkItem]:
        """Wait for work. With a delay, a short batch waits up to that long after its oldest
        item, but only for images already admitted and still decoding: nothing waits for
        requests that may never come, so a lone request is taken at once at any delay."""
        while True:
            oldest = self._oldest()
            if oldest is None:
                await self._wait(None)
                continue
            if max_delay_s > 0:
                until = oldest[1].enqueued_at + max_delay_s
                # Re-checked every RECHECK_S too: an admission given back without anything
                # queued (a failed decode, a client gone) does not wake the queue.
                while not self._full_or_none_coming(max_n):
                    left = until - time.perf_counter()
                    if left <= 0:
                        break
                    await self._wait(min(left, RECHECK_S))
            batch = self._pop(max_n, batch_seconds)
            if batch:
                return batch


def _arrival(item: WorkItem) -> int:
    return item.seq


def _wake_one(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
