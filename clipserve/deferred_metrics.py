"""Per-request metric updates, summed in plain Python and applied to Prometheus in bulk.

A request updates about eighteen counters and histograms. Through prometheus_client each update
takes a lock and, under --workers N, writes an mmap'd file: 20-46 µs a request (4-10% of a
tensor request's CPU; bench/metrics_updates.py). Here an update is a dict entry or a bucket
count, and the children get one `inc` per label set per flush.

When the numbers reach Prometheus:
- before anything reads them: `Metrics` registers `FlushFirst` as its registry's first collector
  (so /metrics, `samples()` and `registry.get_sample_value` see every update made before), and
  flushes before it reads the other processes' files;
- under --workers N, also once per event loop iteration (a `call_soon` from the first update of
  an iteration), since other processes read this one's files: a batch's requests finish in the
  same iteration and share one write per label set;
- when the app stops (its lifespan flushes).

The sums are exact for counts; a sum of seconds may differ from one-at-a-time addition in the
last bit. Histogram buckets are Prometheus's: the first upper bound >= the value. A flush
writes a histogram child's bucket and sum values directly (`_buckets`, `_sum`: the public
`observe` takes one value at a time); tests/test_deferred_metrics.py compares the exposition
with one-at-a-time updates, so a prometheus_client that changes them fails there first.
"""

from __future__ import annotations

import asyncio
import threading
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from types import TracebackType

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import Metric
from prometheus_client.registry import Collector


class _Pending:
    """One histogram child's observations since the last flush: counts of the buckets they fell
    in (a dict: a flush writes only those) and their sum."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, child: Histogram) -> None:
        self.bounds: list[float] = list(child._upper_bounds)
        self.counts: dict[int, int] = {}
        self.total = 0.0


class DeferredUpdates:
    """Counter, histogram and gauge updates of labelled children (`metric.labels(...)`), made
    inside `with deferred:` (one lock for a request's updates) and applied by `flush`."""

    def __init__(self, every_iteration: bool = False) -> None:
        self.every_iteration = every_iteration
        self._lock = threading.Lock()
        self._adds: dict[Counter, float] = {}
        self._observed: dict[Histogram, _Pending] = {}
        self._sets: dict[Gauge, float] = {}
        self._scheduled = False

    def __enter__(self) -> DeferredUpdates:
        self._lock.acquire()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        schedule = self.every_iteration and not self._scheduled
        self._scheduled = self._scheduled or schedule
        self._lock.release()
        if schedule:
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:  # no loop in this thread: written through
                self.flush()

    def add(self, child: Counter, amount: float = 1.0) -> None:
        # Refused where it is made, as Counter.inc does, not at a later flush.
        self.add_all(((child, amount),))

    def observe(self, child: Histogram, value: float) -> None:
        self.observe_all(((child, value),))

    def add_all(self, pairs: Iterable[tuple[Counter, float]]) -> None:
        """`add` for each pair: a request's counters in one call (no call per counter)."""
        adds = self._adds
        for child, amount in pairs:
            if amount < 0:
                raise ValueError("counters can only be incremented by non-negative amounts")
            adds[child] = adds.get(child, 0.0) + amount

    def observe_all(self, pairs: Iterable[tuple[Histogram, float]]) -> None:
        """`observe` for each pair."""
        observed = self._observed
        for child, value in pairs:
            pending = observed.get(child)
            if pending is None:
                pending = observed[child] = _Pending(child)
            pending.total += value
            if value == value:  # NaN falls in no bucket, as in Histogram.observe
                counts, bucket = pending.counts, bisect_left(pending.bounds, value)
                counts[bucket] = counts.get(bucket, 0) + 1

    def set(self, child: Gauge, value: float) -> None:
        self._sets[child] = value

    def flush(self) -> None:
        """Apply every update made so far (under the lock: a reader never sees half of them)."""
        with self._lock:
            self._scheduled = False
            adds, observed, sets = self._adds, self._observed, self._sets
            if not (adds or observed or sets):
                return
            self._adds, self._observed, self._sets = {}, {}, {}
            for counter, amount in adds.items():
                counter.inc(amount)
            for histogram, pending in observed.items():
                histogram._sum.inc(pending.total)
                buckets = histogram._buckets
                for bucket, n in pending.counts.items():
                    buckets[bucket].inc(n)
            for gauge, value in sets.items():
                gauge.set(value)


class FlushFirst(Collector):
    """Registered before a registry's metrics: collecting flushes the deferred updates, so the
    metrics collected after it include them. It yields no metric of its own."""

    def __init__(self, deferred: DeferredUpdates) -> None:
        self.deferred = deferred

    def collect(self) -> Iterator[Metric]:
        self.deferred.flush()
        return iter(())
