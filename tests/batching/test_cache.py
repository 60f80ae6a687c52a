"""The embedding cache: its byte-bounded LRU, and single-flight keyed runs through a real
Batcher over the fake executor."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

from clipserve.backends.fake import FakeExecutor
from clipserve.batching import Batcher
from clipserve.batching.cache import ENTRY_OVERHEAD, EmbeddingCache, EmbeddingLRU
from clipserve.config import BatchingConfig
from clipserve.errors import ExecutorFailed, NotReady
from clipserve.metrics import Metrics
from tests.helpers import SPEC_32, marked_array, until_async

DIM = 16
ROW = DIM * 4 + ENTRY_OVERHEAD  # what one entry costs


def test_lru_evicts_least_recently_used_by_bytes() -> None:
    lru = EmbeddingLRU(3 * ROW)
    rows = {k: np.full(DIM, i, np.float32) for i, k in enumerate([b"a", b"b", b"c", b"d"])}
    for key in (b"a", b"b", b"c"):
        assert lru.put(key, rows[key]) == 0
    assert lru.bytes == 3 * ROW
    assert lru.get(b"a") is not None  # a is now the most recent: b leaves first
    assert lru.put(b"d", rows[b"d"]) == 1
    assert lru.get(b"b") is None
    assert [lru.get(k) is not None for k in (b"a", b"c", b"d")] == [True, True, True]
    assert lru.bytes == 3 * ROW and len(lru) == 3


def test_lru_keeps_a_read_only_copy_and_refuses_what_cannot_fit() -> None:
    lru = EmbeddingLRU(ROW)
    batch = np.ones((2, DIM), np.float32)
    lru.put(b"k", batch[0])
    batch[0] = 5  # the batch's output is not the cache's
    kept = lru.get(b"k")
    assert kept is not None and (kept == 1).all() and not kept.flags.writeable
    assert lru.put(b"big", np.ones(DIM * 2, np.float32)) == 0
    assert lru.get(b"big") is None and lru.bytes == ROW


def run(
    test: Callable[[Batcher, FakeExecutor, Metrics], Awaitable[Any]],
    cache_bytes: int = 1 << 20,
    **fake: Any,
) -> Any:
    async def main() -> Any:
        executor = FakeExecutor(SPEC_32, DIM, "sim:0", **fake)
        metrics = Metrics()
        cache = EmbeddingCache(cache_bytes, metrics)
        batcher = Batcher([executor], BatchingConfig(8, 64, 0.0), metrics, cache=cache)
        batcher.start()
        try:
            return await test(batcher, executor, metrics)
        finally:
            await batcher.stop()

    return asyncio.run(main())


async def keyed(
    batcher: Batcher, marks: list[int], keys: list[bytes], fresh: bool = False
) -> np.ndarray:
    ticket = batcher.admit(len(marks))
    try:
        done = await batcher.run(
            ticket,
            [marked_array(m) for m in marks],
            normalize=True,
            request_id="t",
            keys=keys,
            fresh=fresh,
        )
    finally:
        ticket.release_all()
    return done.embeddings


def count(metrics: Metrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name, {"tower": "image"})
    return value or 0.0


def test_identical_items_in_flight_are_computed_once_and_then_cached() -> None:
    async def test(batcher: Batcher, fake: FakeExecutor, metrics: Metrics) -> None:
        # Two requests with the same item while the first is computing, one with it twice.
        first = asyncio.create_task(keyed(batcher, [1], [b"k1"]))
        await until_async(lambda: batcher.workers[0].in_flight == 1)
        second = asyncio.create_task(keyed(batcher, [1, 1], [b"k1", b"k1"]))
        a, b = await asyncio.gather(first, second)
        assert fake.items_run == 1
        assert (a[0] == b[0]).all() and (b[0] == b[1]).all()  # bit for bit
        assert count(metrics, "clipserve_cache_merged_total") == 2
        assert count(metrics, "clipserve_cache_misses_total") == 1
        assert batcher.admission.used == 0  # merged items held no place
        again = await keyed(batcher, [1], [b"k1"])
        assert fake.items_run == 1 and (again[0] == a[0]).all()
        assert count(metrics, "clipserve_cache_hits_total") == 1
        assert batcher.cached([b"k1", b"nope"])[1] is None
        assert (
            metrics.registry.get_sample_value("clipserve_cache_bytes") == DIM * 4 + ENTRY_OVERHEAD
        )

    run(test, latency_ms=150)


def test_a_failed_computation_is_never_cached() -> None:
    async def test(batcher: Batcher, fake: FakeExecutor, metrics: Metrics) -> None:
        with pytest.raises(ExecutorFailed):
            await keyed(batcher, [7], [b"bad"])
        assert batcher.cached([b"bad"]) == [None]
        assert not batcher.cache or not batcher.cache.flights
        with pytest.raises(ExecutorFailed):
            await keyed(batcher, [7], [b"bad"])
        assert fake.attempts == [1, 1]  # computed (and failed) again, not answered from memory

    run(test, fail_pixel=7)


def test_a_cancelled_waiter_does_not_cancel_the_computation_others_wait_for() -> None:
    async def test(batcher: Batcher, fake: FakeExecutor, metrics: Metrics) -> None:
        busy = asyncio.create_task(keyed(batcher, [9], [b"busy"]))  # holds the device
        await until_async(lambda: batcher.workers[0].in_flight == 1)
        leader = asyncio.create_task(keyed(batcher, [2], [b"k2"]))
        await until_async(lambda: len(batcher.queue) == 1)
        follower = asyncio.create_task(keyed(batcher, [2], [b"k2"]))
        await until_async(lambda: count(metrics, "clipserve_cache_merged_total") == 1)
        leader.cancel()  # the request that queued the item goes away
        await asyncio.gather(leader, return_exceptions=True)
        row = await follower
        await busy
        assert fake.items_run == 2  # busy and k2, once
        assert (row[0] == batcher.cached([b"k2"])[0]).all()

    run(test, latency_ms=150)


def test_a_request_leaving_its_computing_item_to_others_returns_at_once() -> None:
    # Its deadline or its client ends the wait: not the batch's end (a 504 up to a batch late).
    async def test(batcher: Batcher, fake: FakeExecutor, metrics: Metrics) -> None:
        leader = asyncio.create_task(keyed(batcher, [4], [b"k4"]))
        await until_async(lambda: batcher.workers[0].in_flight == 1)
        follower = asyncio.create_task(keyed(batcher, [4], [b"k4"]))
        await until_async(lambda: count(metrics, "clipserve_cache_merged_total") == 1)
        leader.cancel()
        await asyncio.gather(leader, return_exceptions=True)
        assert leader.cancelled()
        assert batcher.workers[0].in_flight == 1 and not follower.done()  # still computing
        row = await follower
        assert fake.items_run == 1 and batcher.admission.used == 0
        alone = await keyed(batcher, [4], [b"another key"])  # computed from the same pixels
        assert (row[0] == alone[0]).all() and (batcher.cached([b"k4"])[0] == row[0]).all()

    run(test, latency_ms=300)


def test_an_item_nobody_waits_for_leaves_the_queue_unstarted() -> None:
    async def test(batcher: Batcher, fake: FakeExecutor, metrics: Metrics) -> None:
        busy = asyncio.create_task(keyed(batcher, [9], [b"busy"]))
        await until_async(lambda: batcher.workers[0].in_flight == 1)
        gone = asyncio.create_task(keyed(batcher, [3], [b"k3"]))
        await until_async(lambda: len(batcher.queue) == 1)
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        assert len(batcher.queue) == 0 and batcher.admission.used == 0
        assert batcher.cache is not None and list(batcher.cache.flights) == [b"busy"]
        await busy
        assert fake.items_run == 1

    run(test, latency_ms=150)


def test_a_dead_tower_gives_back_the_places_of_the_cached_items_it_fails() -> None:
    async def test(batcher: Batcher, fake: FakeExecutor, metrics: Metrics) -> None:
        doomed = asyncio.create_task(keyed(batcher, [9], [b"k9"]))
        await until_async(lambda: fake.attempts)  # on the device that it will lose
        waiting = asyncio.create_task(keyed(batcher, [1], [b"k1"]))  # a place of its own
        await until_async(lambda: len(batcher.queue) == 1)
        for request in (doomed, waiting):
            with pytest.raises(NotReady):
                await request
        assert not batcher.alive and batcher.admission.used == 0

    run(test, fatal_pixel=9, latency_ms=50)


def test_fresh_reads_nothing_cached_but_keeps_what_it_computes() -> None:
    async def test(batcher: Batcher, fake: FakeExecutor, metrics: Metrics) -> None:
        first = await keyed(batcher, [4], [b"k4"])
        fresh = await keyed(batcher, [4], [b"k4"], fresh=True)
        assert fake.items_run == 2 and (first == fresh).all()
        assert count(metrics, "clipserve_cache_hits_total") == 0
        await keyed(batcher, [4], [b"k4"])
        assert fake.items_run == 2

    run(test)


def test_eviction_counts_and_bytes_stay_within_the_budget() -> None:
    async def test(batcher: Batcher, fake: FakeExecutor, metrics: Metrics) -> None:
        for mark in range(5):
            await keyed(batcher, [mark], [bytes([mark])])
        assert metrics.registry.get_sample_value("clipserve_cache_evictions_total") == 3
        assert metrics.registry.get_sample_value("clipserve_cache_bytes") == 2 * ROW
        assert batcher.cached([b"\x00", b"\x03", b"\x04"])[0] is None

    run(test, cache_bytes=2 * ROW)
