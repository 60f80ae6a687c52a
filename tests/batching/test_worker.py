"""The pipelined device worker over the fake executor's simulated GPU stream (stream=1): batches
overlap, results keep their owners, failures and shutdown are answered; GPU defaults; the
device-side L2 normalisation; the CUDA staging path where a GPU is present."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
import torch

from clipserve.backends.base import as_async, l2_normalise_rows
from clipserve.backends.fake import FakeExecutor
from clipserve.batching.queue import Admission, BatchQueue, WorkItem
from clipserve.batching.worker import DeviceWorker
from clipserve.config import BatchingConfig, ConfigError, load_config, resolve_device_defaults
from clipserve.errors import ExecutorFailed, NonFiniteEmbedding, NotReady, RequestTimeout
from clipserve.metrics import Metrics
from tests.helpers import SPEC_32, make_config, marked_array, needs_cuda, until_async


def expected(fake: FakeExecutor, mark: int, normalize: bool = True) -> np.ndarray:
    out = fake.features(marked_array(mark)[None]) @ fake._proj
    return l2_normalise_rows(out, np.array([normalize]))[0]


class Harness:
    """One DeviceWorker on its own queue and admission, as the Batcher builds it."""

    def __init__(self, fake: FakeExecutor, depth: int, max_batch_size: int) -> None:
        self.fake = fake
        self.metrics = Metrics()
        self.admission = Admission(10_000)
        self.queue = BatchQueue()
        self.deaths = 0
        self.worker = DeviceWorker(
            fake,
            self.queue,
            max_batch_size=max_batch_size,
            max_delay_s=0.0,
            metrics=self.metrics,
            on_death=self._died,
            pipeline_depth=depth,
        )

    def _died(self) -> None:
        self.deaths += 1

    async def submit(
        self, *marks: int, normalize: bool = True, timeout_s: float | None = None
    ) -> list[WorkItem]:
        loop = asyncio.get_running_loop()
        ticket = self.admission.admit(len(marks))
        now = time.perf_counter()
        deadline = None if timeout_s is None else now + timeout_s
        items = [
            WorkItem(
                marked_array(m), normalize, f"r{m}", loop.create_future(), ticket, now, deadline
            )
            for m in marks
        ]
        await self.queue.put(items)
        return items


def run(
    test: Callable[[Harness], Awaitable[Any]],
    *,
    depth: int = 2,
    max_batch_size: int = 4,
    **fake: Any,
) -> Any:
    async def main() -> Any:
        harness = Harness(
            FakeExecutor(SPEC_32, 16, "sim:0", stream=True, **fake), depth, max_batch_size
        )
        harness.worker.start()
        try:
            return await test(harness)
        finally:
            await harness.worker.stop()
            harness.fake.close()

    return asyncio.run(main())


async def outcome(item: WorkItem) -> np.ndarray | BaseException:
    try:
        return await asyncio.wait_for(asyncio.shield(item.future), 5.0)
    except Exception as exc:
        return exc


def test_only_asynchronous_executors_pipeline() -> None:
    sync = FakeExecutor(SPEC_32, 16, latency_ms=10)
    assert as_async(sync) is None
    worker = DeviceWorker(
        sync, BatchQueue(), max_batch_size=4, max_delay_s=0, metrics=Metrics(), pipeline_depth=3
    )
    assert worker.depth == 1  # the CPU path: one batch at a time, as before
    stream = FakeExecutor(SPEC_32, 16, latency_ms=10, stream=True)
    assert as_async(stream) is stream
    assert (
        DeviceWorker(
            stream,
            BatchQueue(),
            max_batch_size=4,
            max_delay_s=0,
            metrics=Metrics(),
            pipeline_depth=3,
        ).depth
        == 3
    )
    stream.close()


def served_rate(depth: int) -> float:
    """Images per second through one worker whose answers cost the event loop host time, as
    encoding responses does: 40 ms of device time and ~24 ms of loop time per batch of 4."""

    async def test(h: Harness) -> float:
        def host_work(_: Any) -> None:
            time.sleep(0.006)  # holds the loop, as a front end answering an item would

        items = []
        t0 = time.perf_counter()
        for _ in range(12):
            for item in await h.submit(*range(1, 5)):
                item.future.add_done_callback(host_work)
                items.append(item)
        await asyncio.gather(*(item.future for item in items))
        return len(items) / (time.perf_counter() - t0)

    rate: float = run(test, depth=depth, latency_ms=40)
    return rate


def test_depth_two_overlaps_host_work_with_the_device() -> None:
    sequential, pipelined = served_rate(1), served_rate(2)
    # B/L = 100 img/s; sequential B/(L + host) ≈ 62 img/s
    assert pipelined > 1.25 * sequential, (sequential, pipelined)
    assert pipelined > 0.8 * 100, pipelined


def test_results_keep_their_owners_under_concurrency() -> None:
    async def test(h: Harness) -> None:
        async def request(marks: list[int], normalize: bool) -> None:
            # A sleep: requests arrive staggered, so batches mix them in varying ways.
            await asyncio.sleep(0.001 * (marks[0] % 7))
            items = await h.submit(*marks, normalize=normalize)
            rows = await asyncio.gather(*(item.future for item in items))
            for mark, row in zip(marks, rows, strict=True):
                np.testing.assert_allclose(
                    row, expected(h.fake, mark, normalize), rtol=1e-5, atol=1e-6
                )

        requests = [([m, m + 50, m + 100][: 1 + m % 3], m % 2 == 0) for m in range(1, 40)]
        await asyncio.gather(*(request(marks, norm) for marks, norm in requests))
        assert h.fake.items_run == sum(len(marks) for marks, _ in requests)
        assert max(h.fake.batches) <= 5

    run(test, depth=3, max_batch_size=5, latency_ms=5)


def test_batches_are_in_flight_together_and_tickets_free_as_they_start() -> None:
    async def test(h: Harness) -> None:
        first = await h.submit(1, 2)
        second = await h.submit(3, 4)
        third = await h.submit(5)
        await until_async(lambda: h.worker.in_flight == 4)
        assert h.worker.in_flight == 4  # two batches launched, the third waits for a slot
        assert h.admission.used == 1 and len(h.queue) == 1
        await asyncio.gather(*(i.future for i in first + second + third))
        assert h.fake.batches == [2, 2, 1]

    run(test, max_batch_size=2, latency_ms=100)


def test_cost_is_device_time_not_latency_behind_the_batch_ahead() -> None:
    async def test(h: Harness) -> None:
        items = [item for _ in range(8) for item in await h.submit(1, 2)]
        # two batches in flight: the second ends one device time after the first
        await until_async(lambda: h.worker.in_flight == 4)
        now = time.perf_counter()
        await asyncio.gather(*(i.future for i in items))
        assert h.worker.cost.seconds(2) == pytest.approx(0.08, rel=0.25)  # not 2 x 80 ms
        busy = h.metrics.device_busy.labels("sim:0")._value.get()
        assert busy == pytest.approx(8 * 0.08, rel=0.25)
        assert busy <= time.perf_counter() - now + 0.1  # overlapping batches counted once
        late = await h.submit(3, 4)
        more = await h.submit(5, 6)
        # both in flight: done in about two device times, not one
        await until_async(lambda: h.worker.in_flight == 4)
        assert h.worker.remaining_s(time.perf_counter()) == pytest.approx(0.14, abs=0.05)
        await asyncio.gather(*(i.future for i in late + more))
        assert h.worker.remaining_s(time.perf_counter()) == 0.0

    run(test, max_batch_size=2, latency_ms=80)


def test_items_that_cannot_finish_behind_the_batches_in_flight_make_way() -> None:
    async def test(h: Harness) -> None:
        await asyncio.gather(*(i.future for i in await h.submit(1)))  # measured: ~100 ms
        ahead = await h.submit(2)
        await until_async(lambda: len(h.fake.attempts) == 2)  # the batch ahead launched
        # Started now it would end after the batch ahead: ~190 ms, past its 150 ms deadline.
        doomed, fine = await h.submit(3, timeout_s=0.15), await h.submit(4)
        assert isinstance(await outcome(doomed[0]), RequestTimeout)
        assert isinstance(await outcome(fine[0]), np.ndarray)
        await asyncio.gather(*(i.future for i in ahead))
        assert h.fake.attempts == [1, 1, 1]  # 1, 2 and 4: item 3 never ran

    run(test, max_batch_size=1, latency_ms=100)


def test_a_failing_batch_in_flight_is_bisected_and_its_neighbours_answered() -> None:
    async def test(h: Harness) -> None:
        first = await h.submit(1)
        await until_async(lambda: h.fake.attempts)  # launched
        poisoned = await h.submit(7, 8, 9)  # launched while the first computes
        results = [await outcome(i) for i in first + poisoned]
        assert isinstance(results[1], ExecutorFailed)
        for mark, row in zip((1, 8, 9), (results[0], *results[2:]), strict=True):
            assert isinstance(row, np.ndarray)
            np.testing.assert_allclose(row, expected(h.fake, mark), rtol=1e-5, atol=1e-6)
        assert h.fake.attempts == [1, 3, 1, 2]  # [7, 8, 9] failed, then [7] alone and [8, 9]
        assert h.metrics.batch_retries.labels("sim:0")._value.get() == 2
        assert h.metrics.batch_failures.labels("sim:0")._value.get() == 1
        assert h.worker.alive
        (after,) = await h.submit(10)
        assert isinstance(await outcome(after), np.ndarray)

    run(test, latency_ms=60, fail_pixel=7)


def test_out_of_memory_in_flight_splits_until_it_fits() -> None:
    async def test(h: Harness) -> None:
        items = await h.submit(*range(10, 15))
        rows = [await outcome(i) for i in items]
        for mark, row in zip(range(10, 15), rows, strict=True):
            assert isinstance(row, np.ndarray)
            np.testing.assert_allclose(row, expected(h.fake, mark), rtol=1e-5, atol=1e-6)
        assert max(h.fake.batches) <= 2 and h.fake.items_run == 5

    run(test, max_batch_size=8, latency_ms=20, oom_above=2)


def test_non_finite_row_in_flight_fails_only_its_item() -> None:
    async def test(h: Harness) -> None:
        items = await h.submit(4, 5, 6)
        bad, *good = [await outcome(i) for i in (items[1], items[0], items[2])]
        assert isinstance(bad, NonFiniteEmbedding)
        assert all(isinstance(row, np.ndarray) for row in good)
        assert h.fake.batches == [3]

    run(test, latency_ms=20, nan_pixel=5)


def test_fatal_error_answers_every_batch_in_flight_and_ends_the_worker() -> None:
    async def test(h: Harness) -> None:
        doomed = await h.submit(9)
        await until_async(lambda: h.fake.attempts)  # launched on the device it will lose
        behind = await h.submit(1, 2)  # in flight behind the batch that loses the device
        results = [await outcome(i) for i in doomed + behind]
        assert all(isinstance(r, NotReady) and "device was lost" in r.message for r in results)
        assert h.fake.attempts == [1, 2]  # the second batch had been launched
        await until_async(lambda: not h.worker.alive)
        assert not h.worker.alive and h.deaths == 1
        assert "device loss" in (h.worker.error or "")
        assert h.worker.running is None

    run(test, latency_ms=50, fatal_pixel=9)


def test_stop_mid_flight_answers_every_item() -> None:
    async def test(h: Harness) -> None:
        items = [item for _ in range(3) for item in await h.submit(1, 2)]
        await until_async(lambda: h.worker.in_flight == 4)
        t0 = time.perf_counter()
        await h.worker.stop()
        results = [await outcome(i) for i in items[:4]]
        assert time.perf_counter() - t0 < 0.2  # answered now, not when the device finishes
        assert all(isinstance(r, NotReady) and "shutting down" in r.message for r in results)
        assert len(h.queue) == 2  # the third batch was never taken

    run(test, max_batch_size=2, latency_ms=300)


def test_device_normalisation_matches_the_host_and_keeps_bad_rows_bad() -> None:
    from clipserve.backends.torch_eager import l2_normalise_device

    rng = np.random.default_rng(0)
    out = rng.standard_normal((6, 8)).astype(np.float32)
    out[1] = 3e38  # squares overflow float32
    out[2, 3] = np.nan
    out[3, 0] = np.inf
    out[4] = 0.0
    mask = np.array([True, True, True, True, True, False])
    got = l2_normalise_device(torch.from_numpy(out), torch.from_numpy(mask)).numpy()
    host = l2_normalise_rows(out, mask)
    finite = [0, 1, 4, 5]
    np.testing.assert_allclose(got[finite], host[finite], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.linalg.norm(got[[0, 1]], axis=1), 1.0, rtol=1e-6)
    assert not np.isfinite(got[2]).all() and not np.isfinite(got[3]).all()
    assert (got[5] == out[5]).all()  # not asked to normalise: left as it was


def test_gpu_defaults_follow_the_devices_and_never_override_a_given_value() -> None:
    default = load_config({}, {})
    assert resolve_device_defaults(default, ["cpu"]).batching == default.batching
    assert resolve_device_defaults(default, ["sim:0", "sim:1"]).batching.max_batch_size == 32
    cuda = resolve_device_defaults(default, ["cuda:0", "cuda:1"]).batching
    assert (cuda.max_batch_size, cuda.max_queue_size) == (256, 4 * 256 * 2)
    flag = resolve_device_defaults(load_config({"max_batch_size": "64"}, {}), ["cuda:0"])
    assert (flag.batching.max_batch_size, flag.batching.max_queue_size) == (64, 256)
    env = load_config({}, {"CLIPSERVE_MAX_QUEUE_SIZE": "100"})
    small = resolve_device_defaults(env, ["cuda:0"]).batching
    assert (small.max_batch_size, small.max_queue_size) == (100, 100)  # the batch fits the queue
    direct = load_config({}, {}).__class__(batching=BatchingConfig(max_batch_size=8))
    assert resolve_device_defaults(direct, ["cuda:0"]).batching.max_batch_size == 8
    assert default.batching.pipeline_depth == 2
    with pytest.raises(ConfigError, match="--pipeline-depth"):
        load_config({"pipeline_depth": "0"}, {})


def _torch_parity(executor: Any, n: int) -> None:
    rng = np.random.default_rng(1)
    h, w = executor.spec.size
    batches = [rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8) for _ in range(3)]
    mask = np.arange(n) % 2 == 0
    launched = [executor.launch(list(b), mask) for b in batches]  # three in flight at once
    rows = [executor.wait(handle) for handle in launched]
    for batch, got in zip(batches, rows, strict=True):
        ref = l2_normalise_rows(executor.run(batch), mask)
        cos = (got[mask] * ref[mask]).sum(1)
        assert cos.min() > 0.999
        np.testing.assert_allclose(got[~mask], ref[~mask], rtol=2e-2, atol=2e-3)
    assert not np.shares_memory(rows[0], rows[1])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["torch", "cuda-graphs"])
def test_cuda_launch_and_wait_match_run_and_own_their_rows(
    backend: str, tiny_config: Any, tiny_checkpoint: Any
) -> None:
    from clipserve.backends.base import ExecutorSpec
    from clipserve.backends.registry import create_executor
    from clipserve.inference.model import load_model

    config = make_config(tiny_config, tiny_checkpoint, backend=backend, gpus="0", max_batch_size=8)
    model = load_model(config.model)
    executor = create_executor(model, ExecutorSpec.from_config(config), "cuda:0")
    executor.warmup([1, 2, 4, 8])
    assert as_async(executor) is executor
    _torch_parity(executor, 5)
    executor.close()


def test_a_batch_launched_after_the_waiter_stopped_is_held_and_failed() -> None:
    """Stopping: a launch the device thread still runs after the completion thread is gone has
    no one to wait for it; its handle (and staging) is kept, not dropped under the device, and
    its items fail rather than hang."""
    from clipserve.batching.worker import _Batch

    async def main() -> None:
        fake = FakeExecutor(SPEC_32, 16, "sim:0", stream=True, latency_ms=50)
        worker = Harness(fake, depth=2, max_batch_size=4).worker
        loop = asyncio.get_running_loop()
        assert worker._waiter is not None
        worker._waiter.shutdown(wait=True)
        batch = _Batch([], time.perf_counter(), np.ones(2, dtype=bool), landed=loop.create_future())
        arrays = [marked_array(1), marked_array(2)]
        batch.items = [
            WorkItem(a, True, f"b{i}", loop.create_future(), None, 0.0)
            for i, a in enumerate(arrays)
        ]  # type: ignore[arg-type]
        worker._launch(batch, loop)
        rows, block, _, error = await asyncio.wait_for(batch.landed, 5)
        assert rows is None and block is None and isinstance(error, RuntimeError)
        assert len(worker._abandoned) == 1
        assert np.asarray(fake.wait(worker._abandoned[0])).shape == (2, 16)  # still computing then
        await worker.stop()

    asyncio.run(main())
