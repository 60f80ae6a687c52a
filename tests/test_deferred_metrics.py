"""Deferred per-request metric updates (clipserve/deferred_metrics.py): what Prometheus shows is
what one-at-a-time updates would show, whenever it is read."""

from __future__ import annotations

import asyncio
import math
import threading

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from clipserve.deferred_metrics import DeferredUpdates, FlushFirst
from clipserve.metrics import _LATENCY_BUCKETS, Metrics

# On bounds, between them, zero, past the last and huge: every bucket edge case.
VALUES = [0.0, 0.0005, 0.0005000001, 0.001, 0.0042, 0.25, 30.0, 30.5, 1e9, *_LATENCY_BUCKETS]


def _metrics(registry: CollectorRegistry) -> tuple[Counter, Histogram, Gauge]:
    counter = Counter("c", "c", ["route"], registry=registry)
    histogram = Histogram("h", "h", ["route"], buckets=_LATENCY_BUCKETS, registry=registry)
    gauge = Gauge("g", "g", ["route"], registry=registry)
    return counter, histogram, gauge


def _exposition(registry: CollectorRegistry) -> list[str]:
    """The text format without the `_created` lines (times of creation differ)."""
    lines = generate_latest(registry).decode().splitlines()
    return [line for line in lines if "_created" not in line]


def test_deferred_updates_read_as_direct_ones() -> None:
    direct, deferred_registry = CollectorRegistry(), CollectorRegistry()
    deferred = DeferredUpdates()
    deferred_registry.register(FlushFirst(deferred))
    dc, dh, dg = _metrics(direct)
    c, h, g = _metrics(deferred_registry)
    for i, value in enumerate(VALUES):
        route = "/a" if i % 3 else "/b"
        dc.labels(route).inc(i)
        dh.labels(route).observe(value)
        dg.labels(route).set(value)
        with deferred as d:
            d.add(c.labels(route), i)
            d.observe(h.labels(route), value)
            d.set(g.labels(route), value)
    assert _exposition(deferred_registry) == _exposition(direct)
    # Read through the registry's own lookup too (what tests and the stats endpoint use).
    total = deferred_registry.get_sample_value("h_count", {"route": "/a"})
    assert total == direct.get_sample_value("h_count", {"route": "/a"})


def test_updates_wait_for_a_read_or_a_flush() -> None:
    deferred = DeferredUpdates()
    counter = Counter("c", "c", registry=CollectorRegistry())
    with deferred as d:
        d.add(counter, 3)
    assert counter._value.get() == 0  # deferred: nothing written yet
    deferred.flush()
    assert counter._value.get() == 3
    deferred.flush()  # nothing pending: nothing added twice
    assert counter._value.get() == 3


def test_a_negative_count_is_refused_where_it_is_made() -> None:
    deferred = DeferredUpdates()
    counter = Counter("c", "c", registry=CollectorRegistry())
    with pytest.raises(ValueError, match="non-negative"), deferred as d:
        d.add(counter, -1)
    deferred.flush()
    assert counter._value.get() == 0


def test_nan_goes_to_the_sum_and_no_bucket_as_prometheus_does() -> None:
    direct, later = CollectorRegistry(), CollectorRegistry()
    deferred = DeferredUpdates()
    later.register(FlushFirst(deferred))
    Histogram("h", "h", registry=direct).observe(math.nan)
    with deferred as d:
        d.observe(Histogram("h", "h", registry=later), math.nan)
    assert _exposition(later) == _exposition(direct)


def test_every_iteration_applies_them_on_the_loops_next_turn() -> None:
    counter = Counter("c", "c", registry=CollectorRegistry())
    deferred = DeferredUpdates(every_iteration=True)

    async def serve() -> list[float]:
        seen = []
        for _ in range(3):  # three requests of one iteration: one write
            with deferred as d:
                d.add(counter)
        seen.append(counter._value.get())
        await asyncio.sleep(0)
        seen.append(counter._value.get())
        with deferred as d:  # a later iteration schedules its own flush
            d.add(counter)
        await asyncio.sleep(0)
        seen.append(counter._value.get())
        return seen

    assert asyncio.run(serve()) == [0, 3, 4]
    with deferred as d:  # no loop in this thread: written through
        d.add(counter)
    assert counter._value.get() == 5


def test_threads_lose_no_update() -> None:
    counter = Counter("c", "c", registry=CollectorRegistry())
    histogram = Histogram("h", "h", registry=CollectorRegistry())
    deferred = DeferredUpdates()
    n, threads = 20_000, 4

    def work() -> None:
        for i in range(n):
            with deferred as d:
                d.add(counter)
                d.observe(histogram, 0.001)
            if i % 1000 == 0:
                deferred.flush()

    runners = [threading.Thread(target=work) for _ in range(threads)]
    for t in runners:
        t.start()
    for t in runners:
        t.join()
    deferred.flush()
    assert counter._value.get() == n * threads
    assert sum(b.get() for b in histogram._buckets) == n * threads


def test_the_apps_metrics_flush_before_any_reader() -> None:
    metrics = Metrics()
    child = metrics.requests.labels("/embed", "200")
    with metrics.deferred as d:
        d.add(child, 2)
        d.observe(metrics.request_duration.labels("/embed"), 0.003)
    assert b'clipserve_requests_total{route="/embed",status="200"} 2.0' in metrics.render()
    with metrics.deferred as d:
        d.add(child)
    sample = metrics.registry.get_sample_value(
        "clipserve_requests_total", {"route": "/embed", "status": "200"}
    )
    assert sample == 3
    with metrics.deferred as d:
        d.add(child)
    (found,) = [s for s in metrics.samples("clipserve_requests_total") if s.labels["route"]]
    assert found.value == 4
