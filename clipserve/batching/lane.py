"""One lane of the batch queue: the queued items that stack together (one dtype and shape), in
arrival order and by deadline, each operation O(1) amortised whatever the lane's length.

An item is in the lane while its `lane` is this one. Items taken or dropped are not searched
for: they are skipped when met, and the lane is compacted when they outnumber the live ones.
Deadlines are kept per group (the items of one `put` that share a deadline): groups whose
deadline is no earlier than the last one's (every request with the same timeout) in a FIFO,
the rest in a heap, so the common case never pays a heap push.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any, Generic, Protocol, TypeVar

# Items with equal keys stack into one batch: (dtype, shape), or ("encoded", ()).
StackKey = tuple[str, tuple[int, ...]]


class Queued(Protocol):
    """What a lane asks of its items (`batching/queue.py`'s WorkItem)."""

    deadline: float | None
    seq: int
    lane: Lane[Any] | None

    @property
    def future(self) -> asyncio.Future[Any]: ...


T = TypeVar("T", bound=Queued)
# A group of items with one deadline: (deadline, tie-breaker, items).
_Group = tuple[float, int, list[T]]
_SLACK = 64  # stale entries tolerated beyond twice the live items before compacting


class Lane(Generic[T]):
    __slots__ = ("groups", "held", "items", "key", "last", "late", "live", "ties")

    def __init__(self, key: StackKey) -> None:
        self.key = key
        self.items: deque[T] = deque()  # arrival order
        self.groups: deque[_Group[T]] = deque()  # deadlines in order, as they arrived
        self.late: list[_Group[T]] = []  # a heap: groups that arrived out of deadline order
        self.last = float("-inf")  # the deadline of the newest group in `groups`
        self.live = 0
        self.held = 0  # items in `groups` and `late`, live or not
        self.ties = 0

    def extend(self, items: list[T], seq: int) -> int:
        """Queue items (all of this key), numbered from seq + 1; returns the last number."""
        group: list[T] = []
        group_deadline: float | None = None
        scheduled = 0
        for item in items:
            seq += 1
            item.seq = seq
            item.lane = self
            deadline = item.deadline
            if deadline is None:
                continue
            scheduled += 1
            if deadline == group_deadline:
                group.append(item)
                continue
            group, group_deadline = [item], deadline
            self._schedule(deadline, group)
        self.items.extend(items)
        self.live += len(items)
        self.held += scheduled
        return seq

    def _schedule(self, deadline: float, group: list[T]) -> None:
        self.ties += 1
        if deadline >= self.last:
            self.groups.append((deadline, self.ties, group))
            self.last = deadline
        else:
            heapq.heappush(self.late, (deadline, self.ties, group))

    def head(self) -> T | None:
        items = self.items
        while items and items[0].lane is not self:
            items.popleft()
        return items[0] if items else None

    def due(self, limit: float, inclusive: bool) -> list[T]:
        """Take the live items whose deadline is before `limit` (or at it, `inclusive`) out of
        the lane. A deadline that moved later since it was queued is scheduled again."""
        out: list[T] = []
        groups, late = self.groups, self.late
        while groups and _before(groups[0][0], limit, inclusive):
            self._due_group(groups.popleft()[2], limit, inclusive, out)
        while late and _before(late[0][0], limit, inclusive):
            self._due_group(heapq.heappop(late)[2], limit, inclusive, out)
        self.live -= len(out)
        return out

    def _due_group(self, group: list[T], limit: float, inclusive: bool, out: list[T]) -> None:
        self.held -= len(group)
        for item in group:
            if item.lane is not self:
                continue
            deadline = item.deadline
            if deadline is None:  # no deadline any more: nothing to schedule
                continue
            if _before(deadline, limit, inclusive):
                item.lane = None
                out.append(item)
            else:
                self._reschedule(item, deadline)

    def take(self, max_n: int) -> tuple[list[T], int]:
        """The first max_n live items whose future is not done, and how many items left the
        lane (those, and the done ones dropped on the way)."""
        batch: list[T] = []
        items = self.items
        gone = 0
        need = max_n
        last: asyncio.Future[Any] | None = None  # a request's items share their future:
        dead = False  # asked once per run of them (nothing changes it during a take)
        while items and need > 0:
            item = items.popleft()
            if item.lane is not self:
                continue
            item.lane = None
            gone += 1
            future = item.future
            if future is not last:
                last, dead = future, future.done()
            if not dead:
                batch.append(item)
                need -= 1
        self.live -= gone
        groups = self.groups  # taken in arrival order: the oldest groups are done with
        while groups and not _any_live(groups[0][2], self):
            self.held -= len(groups.popleft()[2])
        return batch, gone

    def requeue(self, items: list[T]) -> None:
        """Put back items that `due` took out, in their places."""
        for item in items:
            item.lane = self
            assert item.deadline is not None
            self._reschedule(item, item.deadline)
        self.live += len(items)

    def _reschedule(self, item: T, deadline: float) -> None:
        self.ties += 1
        self.held += 1
        heapq.heappush(self.late, (deadline, self.ties, [item]))

    def remove(self, item: T) -> None:
        item.lane = None
        self.live -= 1

    def compact(self) -> None:
        """Let go of items taken or dropped once they outnumber the live ones: O(1) amortised,
        and a queue that many requests left holds none of their arrays. Deadlines in order
        (one timeout for all) leave nothing behind (`take` trims them); a deadline heap holds
        its taken items until it is rebuilt, when they are three quarters of it."""
        if len(self.items) > 2 * self.live + _SLACK:
            self.items = deque(item for item in self.items if item.lane is self)
        if self.held > 4 * self.live + _SLACK:
            self.groups = deque(self._live_groups(self.groups))
            self.late = list(self._live_groups(self.late))
            heapq.heapify(self.late)
            self.held = sum(len(g[2]) for g in self.groups) + sum(len(g[2]) for g in self.late)

    def _live_groups(self, groups: Iterable[_Group[T]]) -> Iterator[_Group[T]]:
        for entry in groups:
            group = entry[2]
            if len(group) == 1:  # most out-of-order groups: kept as they are
                if group[0].lane is self:
                    yield entry
                continue
            live = [item for item in group if item.lane is self]
            if live:
                yield entry[0], entry[1], live

    def __iter__(self) -> Iterator[T]:
        """The live items."""
        return (item for item in self.items if item.lane is self)


def _before(deadline: float, limit: float, inclusive: bool) -> bool:
    return deadline <= limit if inclusive else deadline < limit


def _any_live(group: list[T], lane: Lane[T]) -> bool:
    for item in group:  # noqa: SIM110 (a plain loop: twice as fast as any() over a generator)
        if item.lane is lane:
            return True
    return False
