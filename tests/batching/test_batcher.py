"""The batcher with the fake executor: dispatch rules, ordering, cancellation, failure isolation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

from clipserve.backends.base import l2_normalise_rows
from clipserve.backends.fake import FakeExecutor
from clipserve.batching import Batcher, TowerKind
from clipserve.batching.cost import CostModel
from clipserve.batching.queue import Admission
from clipserve.config import BatchingConfig
from clipserve.errors import (
    ExecutorFailed,
    NonFiniteEmbedding,
    NotReady,
    Overloaded,
    RequestTimeout,
)
from clipserve.metrics import Metrics
from tests.helpers import SPEC_32, marked_array, until_async


def run(
    test: Callable[[Batcher, list[FakeExecutor]], Awaitable[Any]],
    *,
    executors: int = 1,
    max_batch_size: int = 8,
    max_queue_size: int = 64,
    delay_ms: float = 0.0,
    metrics: Metrics | None = None,
    **fake: Any,
) -> Any:
    async def main() -> Any:
        fakes = [FakeExecutor(SPEC_32, 16, f"sim:{i}", **fake) for i in range(executors)]
        config = BatchingConfig(max_batch_size, max_queue_size, delay_ms)
        batcher = Batcher(fakes, config, metrics or Metrics())
        batcher.start()
        try:
            return await test(batcher, fakes)
        finally:
            await batcher.stop()

    return asyncio.run(main())


async def submit(
    batcher: Batcher, *marks: int, normalize: bool = False, timeout_s: float | None = None
) -> np.ndarray:
    deadline = None if timeout_s is None else time.perf_counter() + timeout_s
    ticket = batcher.admit(len(marks), deadline)
    arrays = [marked_array(m) for m in marks]
    try:
        done = await batcher.run(
            ticket, arrays, normalize=normalize, request_id="t", deadline=deadline
        )
    finally:
        ticket.release_all()  # the caller owns its admission, as the pipeline does
    return done.embeddings


def expected(fake: FakeExecutor, *marks: int) -> np.ndarray:
    return fake.features(np.stack([marked_array(m) for m in marks])) @ fake._proj


def assert_rows(out: np.ndarray, want: np.ndarray) -> None:
    """Rows computed in a batch of another size than `want`'s: BLAS may sum them in another
    order (one row and several can take different kernels: numpy 2.4.6 here does), so a value
    near zero can differ by a few float32 steps of the row's scale, not of its own."""
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6 * float(np.abs(want).max()))


def test_idle_worker_takes_a_single_item_at_once() -> None:
    async def test(batcher: Batcher, fakes: list[FakeExecutor]) -> None:
        out = await asyncio.wait_for(submit(batcher, 3), 1.0)
        assert fakes[0].batches == [1]
        np.testing.assert_allclose(out, expected(fakes[0], 3), rtol=1e-6)

    run(test)


def test_next_batch_fills_while_worker_is_busy_and_results_keep_order() -> None:
    async def test(batcher: Batcher, fakes: list[FakeExecutor]) -> None:
        first = asyncio.create_task(submit(batcher, 1))
        await until_async(lambda: fakes[0].attempts)  # the worker is now busy with the first batch
        rest = [asyncio.create_task(submit(batcher, m)) for m in (10, 11, 12, 13, 14)]
        outs = await asyncio.gather(first, *rest)
        assert fakes[0].batches == [1, 5]
        for mark, out in zip((1, 10, 11, 12, 13, 14), outs, strict=True):
            assert_rows(out, expected(fakes[0], mark))

    run(test, latency_ms=100)


def test_max_batch_size_caps_each_batch() -> None:
    async def test(batcher: Batcher, fakes: list[FakeExecutor]) -> None:
        first = asyncio.create_task(submit(batcher, 1))
        await until_async(lambda: fakes[0].attempts)  # computing: the rest queue behind it
        await asyncio.gather(first, *(submit(batcher, m) for m in range(20, 30)))
        assert fakes[0].batches == [1, 4, 4, 2]

    run(test, max_batch_size=4, latency_ms=50)


def test_queue_delay_waits_for_images_still_decoding_but_not_past_the_delay() -> None:
    async def test(batcher: Batcher, fakes: list[FakeExecutor]) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        decoding = batcher.admit(1)  # admitted, its image not decoded yet
        first = asyncio.create_task(submit(batcher, 1))
        # A sleep: the image decodes 50 ms after the first arrives, within the 200 ms delay.
        await asyncio.sleep(0.05)
        await asyncio.gather(
            first, batcher.run(decoding, [marked_array(2)], normalize=False, request_id="t")
        )
        assert fakes[0].batches == [2]  # the idle worker waited for the decoding image
        t1 = loop.time()
        late = batcher.admit(1)  # never queued: the worker waits only as long as the delay
        await submit(batcher, 3)
        assert fakes[0].batches == [2, 1]
        assert 0.15 <= loop.time() - t1 < 1.0  # ...the 200 ms delay, not longer
        late.release_all()
        assert loop.time() - t0 < 2.0

    run(test, delay_ms=200)


def test_admitted_counts_places_held_outside_the_queue_too() -> None:
    async def test(batcher: Batcher, fakes: list[FakeExecutor]) -> None:
        reading = batcher.admit(2)  # a request being read or looked up: no item queued yet
        assert (batcher.admitted(), batcher.depth()) == (2, 0)
        reading.release_all()
        assert batcher.admitted() == 0

    run(test)


def test_queue_delay_never_holds_a_lone_request() -> None:
    async def test(batcher: Batcher, fakes: list[FakeExecutor]) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await submit(batcher, 1)  # nothing else admitted: nothing to wait for
        assert loop.time() - t0 < 0.5  # far below the 5 s delay
        assert fakes[0].batches == [1]

    run(test, delay_ms=5000)


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
        await until_async(lambda: fakes[0].attempts)  # computing
        doomed = asyncio.create_task(submit(batcher, 2, 3))
        await until_async(lambda: batcher.depth() == 2)
        assert batcher.depth() == 2
        doomed.cancel()
        await until_async(lambda: batcher.depth() == 0)
        assert batcher.depth() == 0
        assert batcher.admission.used == 0  # its slots are free again
        await first
        await submit(batcher, 4)
        assert fakes[0].batches == [1, 1]  # items 2 and 3 never reached the executor

    run(test, latency_ms=100)


def test_poisoned_item_fails_alone_and_its_batch_neighbours_are_answered() -> None:
    metrics = Metrics()

    async def test(batcher: Batcher, fakes: list[FakeExecutor]) -> None:
        first = asyncio.create_task(submit(batcher, 1))
        await until_async(lambda: fakes[0].attempts)  # computing
        poisoned = asyncio.create_task(submit(batcher, 7))  # batch 2: [7, 8, 9]
        neighbours = [asyncio.create_task(submit(batcher, m)) for m in (8, 9)]
        await until_async(lambda: batcher.depth() == 3)  # all three queued behind the first
        assert (await first).shape == (1, 16)
        with pytest.raises(ExecutorFailed):
            await poisoned
        for mark, task in zip((8, 9), neighbours, strict=True):
            assert_rows(await task, expected(fakes[0], mark))
        # [7, 8, 9] failed, then [7] failed and [8, 9] ran: two retries, one failed batch
        assert fakes[0].attempts == [1, 3, 1, 2]
        assert metrics.batch_retries.labels("sim:0")._value.get() == 2
        assert metrics.batch_failures.labels("sim:0")._value.get() == 1
        assert metrics.items._value.get() == 3  # computed: 1, 8 and 9
        assert_rows(await submit(batcher, 9), expected(fakes[0], 9))
        assert all(w.alive for w in batcher.workers)

    run(test, latency_ms=100, fail_pixel=7, metrics=metrics)


def test_out_of_memory_splits_the_batch_until_it_fits() -> None:
    async def test(batcher: Batcher, fakes: list[FakeExecutor]) -> None:
        outs = await asyncio.gather(*(submit(batcher, m) for m in range(10, 15)))
        for mark, out in zip(range(10, 15), outs, strict=True):
            assert_rows(out, expected(fakes[0], mark))
        assert fakes[0].attempts[0] == 5 and max(fakes[0].batches) <= 2
        assert fakes[0].items_run == 5

    run(test, oom_above=2, delay_ms=100)


def test_splitting_is_bounded_when_every_item_fails() -> None:
    async def test(batcher: Batcher, fakes: list[FakeExecutor]) -> None:
        results = await asyncio.gather(
            *(submit(batcher, 7) for _ in range(4)), return_exceptions=True
        )
        assert all(isinstance(r, ExecutorFailed) for r in results)
        assert fakes[0].attempts == [4, 2, 1, 1, 2, 1, 1]  # 4 → halves → single items

    run(test, fail_pixel=7, delay_ms=100)


def test_non_finite_row_fails_only_its_item() -> None:
    metrics = Metrics()

    async def test(batcher: Batcher, fakes: list[FakeExecutor]) -> None:
        bad, good = await asyncio.gather(
            submit(batcher, 5), submit(batcher, 6), return_exceptions=True
        )
        assert isinstance(bad, NonFiniteEmbedding)
        assert "non-finite" in bad.message
        assert_rows(good, expected(fakes[0], 6))
        assert fakes[0].batches == [2]  # one batch: the row, not the batch, was refused
        with pytest.raises(NonFiniteEmbedding, match="item 1: "):
            await submit(batcher, 6, 5, 6)  # in a list, the error names the item
        # A model fault, counted apart from clients' errors (alerts.yml watches it).
        count = metrics.registry.get_sample_value(
            "clipserve_non_finite_items_total", {"tower": "image"}
        )
        assert count == 2

    run(test, nan_pixel=5, delay_ms=50, metrics=metrics)


def test_huge_finite_outputs_normalise_to_unit_length() -> None:
    out = np.full((2, 4), 3e38, dtype=np.float32)  # squares overflow float32
    normed = l2_normalise_rows(out, np.array([True, False]))
    np.testing.assert_allclose(normed[0], [0.5, 0.5, 0.5, 0.5], rtol=1e-6)
    assert (normed[1] == out[1]).all()


def test_fatal_executor_error_kills_the_worker_and_fails_queued_work() -> None:
    async def test(batcher: Batcher, fakes: list[FakeExecutor]) -> None:
        doomed = asyncio.create_task(submit(batcher, 9))
        await until_async(lambda: fakes[0].attempts)  # on the device that it will lose
        waiting = asyncio.create_task(submit(batcher, 1))
        with pytest.raises(NotReady, match="device was lost"):  # retryable elsewhere, not 500
            await doomed
        with pytest.raises(NotReady):
            await asyncio.wait_for(waiting, 1.0)  # failed at once, not left to time out
        assert not batcher.alive
        assert "device loss" in (batcher.workers[0].error or "")
        with pytest.raises(NotReady):
            batcher.admit(1)

    run(test, fatal_pixel=9, latency_ms=50)


def test_stopping_a_worker_mid_batch_answers_its_items() -> None:
    async def test(batcher: Batcher, fakes: list[FakeExecutor]) -> None:
        computing = asyncio.create_task(submit(batcher, 1))
        await until_async(lambda: batcher.workers[0].running)
        await batcher.stop()
        with pytest.raises(NotReady, match="shutting down"):
            await asyncio.wait_for(computing, 1.0)  # answered, not stranded until a timeout

    run(test, latency_ms=300)


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
        await until_async(lambda: fakes[0].attempts)  # computing: the rest queue behind it
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


def test_cost_model_learns_fixed_and_per_item_cost() -> None:
    cost = CostModel()
    assert cost.seconds(8) == 0.0  # nothing measured: no estimate
    cost.observe(4, 0.04)
    assert cost.seconds(8) == pytest.approx(0.08)  # one size seen: proportional
    for n in (1, 2, 4, 8, 16, 32) * 5:
        cost.observe(n, 0.010 + 0.002 * n)
    assert cost.seconds(64) == pytest.approx(0.010 + 0.002 * 64, rel=0.05)
    assert cost.seconds(1) == pytest.approx(0.012, rel=0.1)


async def measured(batcher: Batcher) -> None:
    """One batch run to completion, so every worker's cost estimate is measured."""
    await asyncio.gather(*(submit(batcher, 1) for _ in batcher.workers))
    assert all(w.cost.ready for w in batcher.workers)


def test_admission_refuses_fast_with_retry_after_when_the_queue_cannot_drain_in_time() -> None:
    async def test(batcher: Batcher, fakes: list[FakeExecutor]) -> None:
        await measured(batcher)  # 100 ms per image
        queued = [asyncio.create_task(submit(batcher, m)) for m in range(10, 16)]
        # A batch of 2 computing, the other 4 queued.
        await until_async(lambda: len(fakes[0].attempts) == 2 and batcher.depth() == 4)
        ahead = batcher.admission.used  # 6 queued, less the 2 computing
        # the images ahead and this one at ~100 ms each, after the batch of 2 computing now
        per = batcher.workers[0].cost.seconds(1)
        assert per * (ahead + 1) <= batcher.estimated_wait_s(1) <= per * (ahead + 3)
        with pytest.raises(Overloaded) as refused:  # at once: admit() never waits
            batcher.admit(1, time.perf_counter() + 0.4)
        assert refused.value.retry_after_s >= 1
        assert "deadline" in refused.value.message
        assert batcher.admission.used == ahead  # nothing was reserved for it
        batcher.admit(1, time.perf_counter() + 5.0).release_all()  # a later deadline fits
        await asyncio.gather(*queued)
        assert sum(fakes[0].batches) == 7  # the refused image never ran

    run(test, max_batch_size=2, per_item_ms=100)


def test_estimated_wait_spreads_the_queue_over_live_workers() -> None:
    async def test(batcher: Batcher, fakes: list[FakeExecutor]) -> None:
        await measured(batcher)  # about 50 ms per image each, more on a busy machine
        rates = [1 / w.cost.seconds(1) for w in batcher.workers]  # images/s, batches of 1
        assert batcher.estimated_wait_s(4) == pytest.approx(4 / sum(rates), rel=1e-6)
        assert batcher.estimated_wait_s(4) < 4 / max(rates)  # faster than either one alone

    run(test, executors=2, max_batch_size=1, per_item_ms=50)


def test_cold_start_admits_before_anything_is_measured() -> None:
    async def test(batcher: Batcher, fakes: list[FakeExecutor]) -> None:
        busy = [asyncio.create_task(submit(batcher, m)) for m in (1, 2, 3)]
        await until_async(lambda: fakes[0].attempts)  # busy, nothing measured yet
        assert batcher.estimated_wait_s(1) == 0.0
        batcher.admit(1, time.perf_counter() + 0.01).release_all()  # no estimate: admitted
        await asyncio.gather(*busy)

    run(test, latency_ms=100)


def test_expired_items_never_reach_the_executor() -> None:
    metrics = Metrics()

    async def test(batcher: Batcher, fakes: list[FakeExecutor]) -> None:
        first = asyncio.create_task(submit(batcher, 1))  # computing for 200 ms, unmeasured
        await until_async(lambda: fakes[0].attempts)
        with pytest.raises(RequestTimeout):
            await submit(batcher, 2, 3, timeout_s=0.05)
        await first
        await submit(batcher, 4)
        assert fakes[0].attempts == [1, 1]  # items 2 and 3 never ran
        assert batcher.depth() == 0 and batcher.admission.used == 0

    run(test, latency_ms=200, metrics=metrics)


def test_items_that_cannot_finish_in_time_make_way_for_those_that_can() -> None:
    metrics = Metrics()

    async def test(batcher: Batcher, fakes: list[FakeExecutor]) -> None:
        await measured(batcher)  # 300 ms per batch
        first = asyncio.create_task(submit(batcher, 2))
        await until_async(lambda: len(fakes[0].attempts) == 2)  # computing
        # admitted without a deadline, so only the scheduler can refuse to start it
        t0 = time.perf_counter()
        ticket = batcher.admit(1)
        doomed = batcher.run(
            ticket, [marked_array(3)], normalize=False, request_id="d", deadline=t0 + 0.5
        )
        fine = asyncio.create_task(submit(batcher, 4))
        with pytest.raises(RequestTimeout, match="too close"):
            await doomed  # when the worker comes to it at ~0.3 s, it cannot finish by 0.5 s
        await asyncio.gather(first, fine)
        assert fakes[0].attempts == [1, 1, 1]  # 1, 2, 4: item 3 never ran
        assert metrics.expired_items.labels("image")._value.get() == 1

    run(test, latency_ms=300, metrics=metrics)


def test_an_idle_worker_still_runs_work_its_estimate_calls_too_slow() -> None:
    async def test(batcher: Batcher, fakes: list[FakeExecutor]) -> None:
        await measured(batcher)  # 200 ms per batch
        await submit(batcher, 5, timeout_s=0.1)  # admitted and run: nothing is ahead of it
        assert fakes[0].attempts == [1, 1]  # so a stale estimate is measured again

    run(test, latency_ms=200)


def test_places_are_given_back_request_by_request_as_a_mixed_batch_starts() -> None:
    async def test(batcher: Batcher, fakes: list[FakeExecutor]) -> None:
        first = asyncio.create_task(submit(batcher, 1))
        await until_async(lambda: fakes[0].attempts)  # computing: the rest queue behind it
        tickets = [batcher.admit(3), batcher.admit(2)]
        runs = [
            asyncio.create_task(
                batcher.run(
                    ticket, [marked_array(m) for m in marks], normalize=False, request_id="r"
                )
            )
            for ticket, marks in zip(tickets, [(2, 3, 4), (5, 6)], strict=True)
        ]
        await until_async(lambda: batcher.depth() == 5)
        assert batcher.admission.used == 5
        await until_async(lambda: len(fakes[0].attempts) == 2)  # [2, 3, 4, 5] computing
        assert batcher.admission.used == 1  # three places of one request, one of the other
        done = await asyncio.gather(first, *runs)
        assert [len(d.embeddings) for d in done[1:]] == [3, 2]
        assert fakes[0].batches == [1, 4, 1]
        assert batcher.admission.used == 0

    run(test, max_batch_size=4, latency_ms=100)


@pytest.mark.parametrize(("kind", "items"), [("image", "images"), ("text", "texts")])
def test_a_full_queue_names_what_it_holds(kind: TowerKind, items: str) -> None:
    """The 503's message counts the tower's own items (a full text queue holds texts)."""

    async def main() -> None:
        config = BatchingConfig(max_batch_size=2, max_queue_size=2)
        batcher = Batcher([FakeExecutor(SPEC_32, 16, "sim:0")], config, Metrics(), kind=kind)
        batcher.start()
        try:
            batcher.admit(2)
            with pytest.raises(Overloaded, match=rf"\(2 of 2 {items} admitted, "):
                batcher.admit(1)
        finally:
            await batcher.stop()

    asyncio.run(main())
