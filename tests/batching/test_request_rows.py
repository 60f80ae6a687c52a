"""A request's items answer into one array through one future (`Gathering`): rows land in order
across batches and worker paths, and a request that fails or goes away takes its unstarted items
out of the queue and gives their places back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

from clipserve.backends.fake import FakeExecutor
from clipserve.batching import Batcher
from clipserve.batching.tower import Completed
from clipserve.config import BatchingConfig
from clipserve.errors import NonFiniteEmbedding
from clipserve.metrics import Metrics
from tests.helpers import SPEC_32, marked_array, until_async


def run(
    test: Callable[[Batcher, FakeExecutor], Awaitable[Any]],
    *,
    depth: int = 1,
    max_batch_size: int = 4,
    **fake: Any,
) -> Any:
    """`depth` 2: the pipelined worker over the fake's simulated stream; 1: the synchronous one."""

    async def main() -> Any:
        executor = FakeExecutor(SPEC_32, 16, "sim:0", stream=depth > 1, **fake)
        config = BatchingConfig(max_batch_size, 64, 0.0, pipeline_depth=depth)
        batcher = Batcher([executor], config, Metrics())
        batcher.start()
        try:
            return await test(batcher, executor)
        finally:
            await batcher.stop()

    return asyncio.run(main())


async def submit(batcher: Batcher, *marks: int) -> Completed:
    deadline = time.perf_counter() + 10.0
    ticket = batcher.admit(len(marks), deadline)
    try:
        return await batcher.run(
            ticket, [marked_array(m) for m in marks], normalize=False, request_id="t"
        )
    finally:
        ticket.release_all()


def expected(fake: FakeExecutor, *marks: int) -> np.ndarray:
    return fake.features(np.stack([marked_array(m) for m in marks])) @ fake._proj


@pytest.mark.parametrize("depth", [1, 2])
def test_a_request_split_across_batches_gets_its_rows_in_order(depth: int) -> None:
    async def test(batcher: Batcher, fake: FakeExecutor) -> None:
        first = asyncio.create_task(submit(batcher, 1))
        await until_async(lambda: fake.attempts)  # computing: the rest queue behind it
        big = asyncio.create_task(submit(batcher, *range(20, 26)))
        small = asyncio.create_task(submit(batcher, 30, 31))
        done = await asyncio.gather(first, big, small)
        assert fake.batches == [1, 4, 4]  # the six split 4 + 2, the last batch shared
        np.testing.assert_allclose(done[1].embeddings, expected(fake, *range(20, 26)), rtol=1e-5)
        np.testing.assert_allclose(done[2].embeddings, expected(fake, 30, 31), rtol=1e-5)
        # its items waited behind the first batch and computed in two: both measured
        assert done[1].queue_s > 0.04
        assert 0.04 < done[1].compute_s < done[1].queue_s + 1.0
        assert batcher.admission.used == 0

    run(test, depth=depth, latency_ms=50)


def test_a_failed_request_drops_its_queued_items_and_gives_their_places_back() -> None:
    async def test(batcher: Batcher, fake: FakeExecutor) -> None:
        first = asyncio.create_task(submit(batcher, 1))
        await until_async(lambda: fake.attempts)
        failing = asyncio.create_task(submit(batcher, 5, 6, 7, 8, 9, 10))  # 5's row is NaN
        after = asyncio.create_task(submit(batcher, 11))
        await until_async(lambda: batcher.depth() == 7)
        await first
        with pytest.raises(NonFiniteEmbedding, match="item 0: "):
            await failing
        np.testing.assert_allclose((await after).embeddings, expected(fake, 11), rtol=1e-5)
        # [5, 6, 7, 8] ran and failed the request; 9 and 10 never did: 11 ran alone
        assert fake.batches == [1, 4, 1]
        assert batcher.admission.used == 0
        assert batcher.depth() == 0

    run(test, nan_pixel=5, latency_ms=50)


@pytest.mark.parametrize(("depth", "queued", "batches"), [(1, 4, [2, 1]), (2, 2, [2, 2, 1])])
def test_a_request_gone_mid_way_frees_what_had_not_started(
    depth: int, queued: int, batches: list[int]
) -> None:
    async def test(batcher: Batcher, fake: FakeExecutor) -> None:
        big = asyncio.create_task(submit(batcher, *range(20, 26)))
        await until_async(lambda: fake.attempts and batcher.depth() == queued)
        await asyncio.sleep(0.01)  # nothing more is taken while the device is busy
        assert batcher.depth() == queued
        big.cancel()
        await until_async(lambda: batcher.depth() == 0)
        assert batcher.admission.used == 0
        out = await submit(batcher, 40)  # the worker goes on; the rest of `big` never ran
        np.testing.assert_allclose(out.embeddings, expected(fake, 40), rtol=1e-5)
        assert fake.batches == batches

    run(test, depth=depth, max_batch_size=2, latency_ms=50)
