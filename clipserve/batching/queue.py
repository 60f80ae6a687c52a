"""Work items, admission control and the queue batches are formed from.

Everything here runs on the event loop; nothing blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from clipserve.errors import Overloaded, RequestTimeout

RECHECK_S = 0.002


def is_encoded(array: np.ndarray) -> bool:
    """An image still encoded (`--decode gpu`: a JPEG's bytes); crops are (H, W, 3), tensors
    (3, H, W), token rows are int64."""
    return array.ndim == 1 and array.dtype == np.uint8


class Admission:
    """Counts images admitted and not yet computing, so decode backlog and queue stay bounded."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0

    def fits(self, n: int) -> bool:
        return self.used + n <= self.capacity

    def full(self, retry_after_s: int = 1) -> Overloaded:
        return Overloaded(
            f"server queue is full ({self.used} of {self.capacity} images waiting); retry later",
            retry_after_s,
        )

    def admit(self, n: int, deadline: float | None = None) -> Ticket:
        if not self.fits(n):
            raise self.full()
        self.used += n
        return Ticket(self, n, deadline)


@dataclass(eq=False)
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


@dataclass(eq=False)
class WorkItem:
    array: np.ndarray  # uint8 HWC, or normalised float CHW
    normalize: bool
    request_id: str
    future: asyncio.Future[np.ndarray]
    ticket: Ticket
    enqueued_at: float  # time.perf_counter()
    deadline: float | None = None  # time.perf_counter(); past it the item is dropped unstarted
    started_at: float = 0.0
    finished_at: float = 0.0

    @property
    def stack_key(self) -> tuple[str, tuple[int, ...]]:
        """Items with equal keys can be stacked into one batch: one dtype and shape. Encoded
        images of any length batch together (the device worker decodes them into crops first)."""
        if is_encoded(self.array):
            return ("encoded", ())
        return (self.array.dtype.str, self.array.shape)


def _no_cost(n: int) -> float:
    return 0.0


class BatchQueue:
    """FIFO of work items shared by every device worker of one model."""

    def __init__(
        self,
        on_expired: Callable[[int], None] = lambda n: None,
        admitted: Callable[[], int] = lambda: 0,
    ) -> None:
        self._items: deque[WorkItem] = deque()
        self._cond = asyncio.Condition()
        self.on_expired = on_expired  # told how many items were dropped for their deadline
        # Images admitted and not started: those queued here, and those still decoding.
        self.admitted = admitted

    def __len__(self) -> int:
        return len(self._items)

    async def put(self, items: Iterable[WorkItem]) -> None:
        async with self._cond:
            self._items.extend(items)
            self._cond.notify_all()

    def discard(self, items: Iterable[WorkItem]) -> None:
        """Drop items that have not started (their request timed out, failed or went away)."""
        gone = {id(item) for item in items}
        self._items = deque(item for item in self._items if id(item) not in gone)

    def fail_all(self, error: Exception) -> None:
        while self._items:
            item = self._items.popleft()
            if not item.future.done():
                item.future.set_exception(error)

    def _prune(self) -> None:
        while self._items and self._items[0].future.done():
            self._items.popleft()

    def _live(self) -> int:
        return sum(1 for item in self._items if not item.future.done())

    def _expire(self, items: list[WorkItem], why: str) -> None:
        for item in items:
            item.ticket.release(1)
            if not item.future.done():
                item.future.set_exception(RequestTimeout(why))
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
        self._prune()
        if not self._items:
            return []
        now = time.perf_counter()
        key = self._items[0].stack_key
        live = sum(1 for item in self._items if item.stack_key == key and not item.future.done())
        finish_by = now + batch_seconds(min(max_n, live))
        batch: list[WorkItem] = []
        doomed: list[WorkItem] = []
        passed: list[WorkItem] = []
        rest: deque[WorkItem] = deque()
        for item in self._items:
            if item.future.done():
                continue
            if item.deadline is not None and item.deadline <= now:
                passed.append(item)
            elif item.stack_key == key and item.deadline is not None and item.deadline < finish_by:
                doomed.append(item)
            elif len(batch) < max_n and item.stack_key == key:
                batch.append(item)
            else:
                rest.append(item)
        if batch:
            self._expire(doomed, "deadline too close to compute the request in time")
        else:
            batch = doomed[:max_n]
            rest.extendleft(reversed(doomed[max_n:]))
        self._expire(passed, "deadline passed while the request was queued")
        self._items = rest
        return batch

    def _full_or_none_coming(self, max_n: int) -> bool:
        """Whether the batch is full, or no admitted image is still on its way (being parsed or
        decoded: admitted and not queued)."""
        live = self._live()
        return live >= max_n or self.admitted() <= live

    async def take(
        self, max_n: int, max_delay_s: float, batch_seconds: Callable[[int], float] = _no_cost
    ) -> list[WorkItem]:
        """Wait for work. With a delay, a short batch waits up to that long after its oldest
        item, but only for images already admitted and still decoding: nothing waits for
        requests that may never come, so a lone request is taken at once at any delay."""
        async with self._cond:
            while True:
                self._prune()
                if not self._items:
                    await self._cond.wait()
                    continue
                if max_delay_s > 0:
                    until = self._items[0].enqueued_at + max_delay_s
                    # Re-checked every RECHECK_S too: an admission given back without anything
                    # queued (a failed decode, a client gone) does not notify the queue.
                    while not self._full_or_none_coming(max_n):
                        left = until - time.perf_counter()
                        if left <= 0:
                            break
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(min(left, RECHECK_S)):
                                await self._cond.wait_for(lambda: self._full_or_none_coming(max_n))
                batch = self._pop(max_n, batch_seconds)
                if batch:
                    return batch
