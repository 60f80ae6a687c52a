"""The batcher with the fake executor: dispatch rules, ordering, cancellation, failure isolation."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

from clipserve.backends.fake import FakeExecutor
from clipserve.batching import Batcher
from clipserve.batching.queue import Admission
from clipserve.config import BatchingConfig
from clipserve.errors import ExecutorFailed, NotReady, Overloaded
from clipserve.metrics import Metrics
from clipserve.preprocess import PreprocessSpec

SPEC = PreprocessSpec((32, 32), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))


def image(mark: int) -> np.ndarray:
    a = np.full((32, 32, 3), mark, dtype=np.uint8)
    a[1:, 1:, 1] = (mark * 7) % 256  # distinct content per mark
    return a


def run(
    test: Callable[[Batcher, list[FakeExecutor]], Awaitable[Any]],
    *,
    executors: int = 1,
    max_batch_size: int = 8,
    max_queue_size: int = 64,
    delay_ms: float = 0.0,
    **fake: Any,
) -> Any:
    async def main() -> Any:
        fakes = [FakeExecutor(SPEC, 16, f"sim:{i}", **fake) for i in range(executors)]
        config = BatchingConfig(max_batch_size, max_queue_size, delay_ms)
        batcher = Batcher(fakes, config, Metrics())
        batcher.start()
        try:
            return await test(batcher, fakes)
        finally:
            await batcher.stop()

    return asyncio.run(main())


async def submit(batcher: Batcher, *marks: int, normalize: bool = False) -> np.ndarray:
    ticket = batcher.admit(len(marks))
    done = await batcher.run(ticket, [image(m) for m in marks], normalize=normalize, request_id="t")
    return done.embeddings


def expected(fake: FakeExecutor, *marks: int) -> np.ndarray:
    return fake.features(np.stack([image(m) for m in marks])) @ fake._proj


def test_idle_worker_takes_a_single_item_at_once() -> None:
    async def test(batcher: Batcher, fakes: list[FakeExecutor]) -> None:
        out = await asyncio.wait_for(submit(batcher, 3), 1.0)
        assert fakes[0].batches == [1]
        np.testing.assert_allclose(out, expected(fakes[0], 3), rtol=1e-6)

    run(test)


def test_next_batch_fills_while_worker_is_busy_and_results_keep_order() -> None:
    async def test(batcher: Batcher, fakes: list[FakeExecutor]) -> None:
        first = asyncio.create_task(submit(batcher, 1))
        await asyncio.sleep(0.03)  # the worker is now busy with the first batch
        rest = [asyncio.create_task(submit(batcher, m)) for m in (10, 11, 12, 13, 14)]
        outs = await asyncio.gather(first, *rest)
        assert fakes[0].batches == [1, 5]
        for mark, out in zip((1, 10, 11, 12, 13, 14), outs, strict=True):
            np.testing.assert_allclose(out, expected(fakes[0], mark), rtol=1e-5)

    run(test, latency_ms=100)


def test_max_batch_size_caps_each_batch() -> None:
    async def test(batcher: Batcher, fakes: list[FakeExecutor]) -> None:
        first = asyncio.create_task(submit(batcher, 1))
        await asyncio.sleep(0.02)
        await asyncio.gather(first, *(submit(batcher, m) for m in range(20, 30)))
        assert fakes[0].batches == [1, 4, 4, 2]

    run(test, max_batch_size=4, latency_ms=50)


def test_queue_delay_waits_for_a_fuller_batch_but_not_past_the_deadline() -> None:
    async def test(batcher: Batcher, fakes: list[FakeExecutor]) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        first = asyncio.create_task(submit(batcher, 1))
        await asyncio.sleep(0.05)
        await asyncio.gather(first, submit(batcher, 2))
        assert fakes[0].batches == [2]  # the idle worker waited for the second item
        assert 0.15 <= loop.time() - t0 < 1.0  # ...until the 200 ms deadline, not longer

    run(test, delay_ms=200)


def test_queue_delay_ends_early_when_the_batch_is_full() -> None:
    async def test(batcher: Batcher, fakes: list[FakeExecutor]) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await submit(batcher, 1, 2, 3, 4)
        assert fakes[0].batches == [4]
        assert loop.time() - t0 < 1.0  # far below the 5 s delay

    run(test, max_batch_size=4, delay_ms=5000)


def test_cancelled_request_is_dropped_before_it_runs() -> None:
    async def test(batcher: Batcher, fakes: list[FakeExecutor]) -> None:
        first = asyncio.create_task(submit(batcher, 1))
        await asyncio.sleep(0.02)
        doomed = asyncio.create_task(submit(batcher, 2, 3))
        await asyncio.sleep(0.01)
        assert batcher.depth() == 2
        doomed.cancel()
        await asyncio.sleep(0.01)
        assert batcher.depth() == 0
        assert batcher.admission.used == 0  # its slots are free again
        await first
        await submit(batcher, 4)
        assert fakes[0].batches == [1, 1]  # items 2 and 3 never reached the executor

    run(test, latency_ms=100)


def test_executor_failure_fails_exactly_its_batch_and_the_worker_keeps_serving() -> None:
    async def test(batcher: Batcher, fakes: list[FakeExecutor]) -> None:
        first = asyncio.create_task(submit(batcher, 1))
        await asyncio.sleep(0.02)
        poisoned = asyncio.create_task(submit(batcher, 7))  # batch 2: [7, 8]
        neighbour = asyncio.create_task(submit(batcher, 8))
        await asyncio.sleep(0.01)
        assert (await first).shape == (1, 16)
        with pytest.raises(ExecutorFailed):
            await poisoned
        with pytest.raises(ExecutorFailed):
            await neighbour
        np.testing.assert_allclose(await submit(batcher, 9), expected(fakes[0], 9), rtol=1e-5)
        assert batcher.all_alive

    run(test, latency_ms=50, fail_pixel=7)


def test_fatal_executor_error_kills_the_worker_and_fails_queued_work() -> None:
    async def test(batcher: Batcher, fakes: list[FakeExecutor]) -> None:
        doomed = asyncio.create_task(submit(batcher, 9))
        await asyncio.sleep(0.02)
        waiting = asyncio.create_task(submit(batcher, 1))
        with pytest.raises(ExecutorFailed):
            await doomed
        with pytest.raises(NotReady):
            await asyncio.wait_for(waiting, 1.0)  # failed at once, not left to time out
        assert not batcher.alive
        assert "device loss" in (batcher.workers[0].error or "")
        with pytest.raises(NotReady):
            batcher.admit(1)

    run(test, fatal_pixel=9, latency_ms=50)


def test_two_workers_share_one_queue() -> None:
    async def test(batcher: Batcher, fakes: list[FakeExecutor]) -> None:
        await asyncio.gather(*(submit(batcher, m) for m in range(8)))
        assert all(f.batches for f in fakes)
        assert sum(f.items_run for f in fakes) == 8

    run(test, executors=2, max_batch_size=2, latency_ms=50)


def test_normalize_is_per_request() -> None:
    async def test(batcher: Batcher, fakes: list[FakeExecutor]) -> None:
        a, b = await asyncio.gather(
            submit(batcher, 5, normalize=True), submit(batcher, 5, normalize=False)
        )
        np.testing.assert_allclose(np.linalg.norm(a), 1.0, rtol=1e-5)
        np.testing.assert_allclose(a * np.linalg.norm(b), b, rtol=1e-4)

    run(test, latency_ms=20)


def test_different_input_kinds_are_never_stacked_together() -> None:
    async def test(batcher: Batcher, fakes: list[FakeExecutor]) -> None:
        first = asyncio.create_task(submit(batcher, 1))
        await asyncio.sleep(0.02)
        floats = np.zeros((3, 32, 32), dtype=np.float32)
        ticket = batcher.admit(1)
        mixed = [
            asyncio.create_task(submit(batcher, 2)),
            asyncio.create_task(batcher.run(ticket, [floats], normalize=False, request_id="f")),
            asyncio.create_task(submit(batcher, 3)),
        ]
        await asyncio.gather(first, *mixed)
        assert fakes[0].batches == [1, 2, 1]

    run(test, latency_ms=50)


def test_admission_bounds_images_waiting_and_frees_them() -> None:
    admission = Admission(4)
    t1 = admission.admit(3)
    with pytest.raises(Overloaded):
        admission.admit(2)
    t1.release(1)
    t2 = admission.admit(2)
    t1.release_all()
    t2.release_all()
    t2.release_all()  # idempotent
    assert admission.used == 0
