"""The batch queue on its own: deadlines in and out of arrival order, kinds kept apart, dropped
items not held, and a request's rows gathered in place across batches."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref

import numpy as np
import pytest

from clipserve.batching.queue import Admission, BatchQueue, Gathering, WorkItem, resolve
from clipserve.errors import RequestTimeout
from tests.helpers import marked_array


def items(
    loop: asyncio.AbstractEventLoop,
    admission: Admission,
    marks: list[int],
    deadline: float | None = None,
    dtype: type = np.uint8,
) -> list[WorkItem]:
    ticket = admission.admit(len(marks), deadline)
    now = time.perf_counter()
    return [
        WorkItem(
            marked_array(m).astype(dtype),
            False,
            f"r{m}",
            loop.create_future(),
            ticket,
            now,
            deadline,
        )
        for m in marks
    ]


def marks_of(batch: list[WorkItem]) -> list[int]:
    return [int(item.array[0, 0, 0]) for item in batch]


def no_cost(n: int) -> float:
    return 0.0


def test_an_early_deadline_queued_behind_later_ones_expires_on_time() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        expired: list[int] = []
        admission = Admission(100)
        queue = BatchQueue(on_expired=expired.append)
        now = time.perf_counter()
        late = items(loop, admission, [1, 2], now + 60)
        soon = items(loop, admission, [3], now + 0.05)  # arrives later, due first
        endless = items(loop, admission, [4])
        queue.put_nowait(late + soon + endless)
        await asyncio.sleep(0.06)
        assert marks_of(queue._pop(1, no_cost)) == [1]  # taking one expires item 3 anywhere
        assert expired == [1]
        with pytest.raises(RequestTimeout, match="passed while the request was queued"):
            await soon[0].future
        assert marks_of(queue._pop(8, no_cost)) == [2, 4]
        assert len(queue) == 0
        assert admission.used == 4 - 1  # the expired item gave its place back

    asyncio.run(main())


def test_a_deadline_moved_later_keeps_its_item_queued() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        queue = BatchQueue()
        now = time.perf_counter()
        (item,) = items(loop, Admission(10), [5], now + 0.02)
        queue.put_nowait([item])
        item.deadline = now + 60  # as the cache does for a second waiter
        await asyncio.sleep(0.03)
        assert queue._pop(4, no_cost) == [item]
        assert not item.future.done()

    asyncio.run(main())


def test_doomed_items_make_way_but_run_when_nothing_else_can() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        queue = BatchQueue()
        admission = Admission(10)
        now = time.perf_counter()
        doomed = items(loop, admission, [1, 2, 3], now + 0.5)
        queue.put_nowait(doomed)
        # Nothing else queued: the oldest doomed items run, the third stays queued.
        assert marks_of(queue._pop(2, lambda n: 1.0)) == [1, 2]
        assert len(queue) == 1
        fine = items(loop, admission, [4], now + 60)
        queue.put_nowait(fine)
        assert marks_of(queue._pop(2, lambda n: 1.0)) == [4]  # now item 3 makes way
        with pytest.raises(RequestTimeout, match="too close"):
            await doomed[2].future

    asyncio.run(main())


def test_kinds_never_stack_and_the_oldest_kind_goes_first() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        queue = BatchQueue()
        admission = Admission(10)
        ints = items(loop, admission, [1, 2])
        floats = items(loop, admission, [3], dtype=np.float32)
        queue.put_nowait([ints[0], *floats, ints[1]])
        assert marks_of(queue._pop(8, no_cost)) == [1, 2]
        assert marks_of(queue._pop(8, no_cost)) == [3]

    asyncio.run(main())


def test_discarded_items_are_not_counted_nor_held() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        queue = BatchQueue()
        admission = Admission(10_000)
        keep = items(loop, admission, [1])
        gone = items(loop, admission, [2 + i % 200 for i in range(2000)], time.perf_counter() + 60)
        queue.put_nowait(keep + gone)
        arrays = [weakref.ref(item.array) for item in gone]
        queue.discard(gone)
        assert len(queue) == 1
        del gone
        gc.collect()
        assert sum(ref() is not None for ref in arrays) == 0  # compacted away, arrays freed
        assert marks_of(queue._pop(8, no_cost)) == [1]

    asyncio.run(main())


def test_a_request_gathers_its_rows_in_order_across_batches() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        queue = BatchQueue()
        gathering = Gathering(loop.create_future(), 5)
        request = items(loop, Admission(10), [10, 11, 12, 13, 14])
        for index, item in enumerate(request):
            item.gathering, item.index = gathering, index
        queue.put_nowait(request)
        for batch in (queue._pop(3, no_cost), queue._pop(3, no_cost)[::-1]):
            for item in batch:
                resolve(item, np.full(4, item.index, np.float32))
        await gathering.future
        assert gathering.rows is not None
        np.testing.assert_array_equal(gathering.rows[:, 0], [0, 1, 2, 3, 4])

    asyncio.run(main())
