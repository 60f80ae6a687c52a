"""Prometheus metrics, owned by the app (a fresh registry per app, so tests never share state).

With --workers N every process (engine, front ends) writes its counters and histograms to files
under PROMETHEUS_MULTIPROC_DIR (the client library's multiprocess mode) and any front end's
/metrics sums them; the scrape-time gauges come from the engine's pushed status instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from clipserve.deferred_metrics import DeferredUpdates, FlushFirst

if TYPE_CHECKING:  # clipserve.batching imports this module
    from clipserve.batching.tower import TowerKind

# The `stage` values of clipserve_stage_duration_seconds, in the order they run (fetch: image
# URLs, --allow-url-fetch). Documentation only: each is named where http/pipeline.py times it.
STAGES = ("receive", "decode", "fetch", "cache", "queue", "compute", "encode")
# Seconds, from half a millisecond to the default request timeout; exact decimals (ms / 1000),
# so the `le` labels read as written.
_LATENCY_MS = (0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10_000, 30_000)
_LATENCY_BUCKETS = tuple(ms / 1000 for ms in _LATENCY_MS)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class _ScrapeTimeGauges(Collector):
    """Values read when Prometheus scrapes, not kept up to date on the hot path."""

    def __init__(
        self,
        queue_depth: Callable[[], Mapping[str, int]],
        admitted: Callable[[], Mapping[str, int]],
        device_memory: Callable[[], Mapping[str, int]],
        workers_alive: Callable[[], Mapping[str, bool]],
        estimated_wait: Callable[[], float],
    ) -> None:
        self.queue_depth = queue_depth
        self.admitted = admitted
        self.device_memory = device_memory
        self.workers_alive = workers_alive
        self.estimated_wait = estimated_wait

    def collect(self) -> Iterator[GaugeMetricFamily]:
        depth = self.queue_depth()
        yield GaugeMetricFamily(
            "clipserve_queue_depth", "Images queued, not yet computing", value=depth["image"]
        )
        yield GaugeMetricFamily(
            "clipserve_text_queue_depth", "Texts queued, not yet computing", value=depth["text"]
        )
        places = GaugeMetricFamily(
            "clipserve_admitted_items",
            "Items holding a place of --max-queue-size (503 when full): queued, or in requests"
            " being read or looked up in the cache",
            labels=["tower"],
        )
        for tower, n in self.admitted().items():
            places.add_metric([tower], n)
        yield places
        yield GaugeMetricFamily(
            "clipserve_estimated_wait_seconds",
            "Estimated time for one more image to be answered, from measured batch times",
            value=self.estimated_wait(),
        )
        memory = GaugeMetricFamily(
            "clipserve_device_memory_bytes", "Device memory held by the executor", labels=["device"]
        )
        for device, used in self.device_memory().items():
            memory.add_metric([device], used)
        yield memory
        alive = GaugeMetricFamily(
            "clipserve_worker_alive",
            "1 while the device worker serves (text tower: text:<device>)",
            labels=["device"],
        )
        for device, ok in self.workers_alive().items():
            alive.add_metric([device], 1.0 if ok else 0.0)
        yield alive


def _latency(
    name: str, documentation: str, labels: Sequence[str], registry: CollectorRegistry
) -> Histogram:
    return Histogram(name, documentation, labels, buckets=_LATENCY_BUCKETS, registry=registry)


def _sizes(name: str, documentation: str, registry: CollectorRegistry) -> Histogram:
    return Histogram(name, documentation, buckets=_BATCH_BUCKETS, registry=registry)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.multiprocess = "PROMETHEUS_MULTIPROC_DIR" in os.environ
        self._gauges: list[Collector] = []
        # The per-request updates (deferred_metrics.py): applied before this registry's
        # metrics are collected, and every loop iteration where other processes read ours.
        self.deferred = DeferredUpdates(every_iteration=self.multiprocess)
        self.registry.register(FlushFirst(self.deferred))
        r = self.registry
        self.requests = Counter(
            "clipserve_requests", "HTTP requests", ["route", "status"], registry=r
        )
        self.request_duration = _latency(
            "clipserve_request_duration_seconds", "Whole request time", ["route"], r
        )
        # Not requests_total: refused before routing (http/guarded.py), probes served instead.
        self.connections_refused = Counter(
            "clipserve_connections_refused",
            "Connections answered 503 past --max-connections",
            registry=r,
        )
        self.stage_duration = _latency(
            "clipserve_stage_duration_seconds", "Time per request stage", ["stage", "protocol"], r
        )
        self.batch_size = _sizes("clipserve_batch_size", "Images per forward pass", r)
        self.batch_duration = _latency(
            "clipserve_batch_duration_seconds", "Forward pass time per batch", ["device"], r
        )
        self.text_batch_size = _sizes(
            "clipserve_text_batch_size", "Texts per text-tower forward pass", r
        )
        self.items = Counter("clipserve_items", "Images embedded", registry=r)
        self.text_items = Counter("clipserve_text_items", "Texts embedded", registry=r)
        self.device_busy = Counter(
            "clipserve_device_busy_seconds",
            "Device time spent on image batches (overlapping batches counted once); "
            "its rate is the busy fraction",
            ["device"],
            registry=r,
        )
        # A model fault answered as the item's 422: counted apart from the clients' own errors.
        self.non_finite = Counter(
            "clipserve_non_finite_items",
            "Items whose embedding came out NaN or infinite (refused, never sent)",
            ["tower"],
            registry=r,
        )
        for tower in ("image", "text"):  # from 0, so a first one is an increase
            self.non_finite.labels(tower)
        self.batch_failures = Counter(
            "clipserve_batch_failures", "Batches failed by the executor", ["device"], registry=r
        )
        self.batch_retries = Counter(
            "clipserve_batch_retries",
            "Sub-batches run again after a batch failed (bisection)",
            ["device"],
            registry=r,
        )
        self.expired_items = Counter(
            "clipserve_expired_items",
            "Queued items dropped unstarted: their deadline came first",
            ["kind"],
            registry=r,
        )
        self.request_bytes = Counter(
            "clipserve_request_bytes", "Request body bytes", ["protocol"], registry=r
        )
        self.response_bytes = Counter(
            "clipserve_response_bytes", "Response body bytes", ["protocol"], registry=r
        )
        # The embedding cache (batching/cache.py), written by the process that holds it: the
        # engine's with --workers N. Per tower: hits + misses + merged = items with a key.
        self.cache_hits = Counter(
            "clipserve_cache_hits", "Items answered from the embedding cache", ["tower"], registry=r
        )
        self.cache_misses = Counter(
            "clipserve_cache_misses",
            "Items computed: not cached, nothing in flight",
            ["tower"],
            registry=r,
        )
        self.cache_merged = Counter(
            "clipserve_cache_merged",
            "Items that waited on an identical one in flight instead of being computed",
            ["tower"],
            registry=r,
        )
        for tower in ("image", "text"):  # at 0 from the start: a sum of them is never empty
            for counter in (self.cache_hits, self.cache_misses, self.cache_merged):
                counter.labels(tower)
        self.cache_evictions = Counter(
            "clipserve_cache_evictions", "Entries evicted to stay within --cache-mb", registry=r
        )
        # Set by one process only: the latest value is the engine's, whatever front ends wrote.
        self.cache_bytes = Gauge(
            "clipserve_cache_bytes",
            "Bytes held by the embedding cache, entries' overhead included",
            registry=r,
            multiprocess_mode="mostrecent",
        )

        # Triton's model statistics (http/stats.py): per tower, summed over the processes.
        self.model_requests = Counter(
            "clipserve_model_requests",
            "Inference requests answered, by tower and outcome (Triton's success/fail)",
            ["tower", "outcome"],
            registry=r,
        )
        self.model_request_seconds = Counter(
            "clipserve_model_request_seconds",
            "Time of the inference requests answered, by tower and outcome",
            ["tower", "outcome"],
            registry=r,
        )
        self.model_stage_seconds = Counter(
            "clipserve_model_stage_seconds",
            "Time of the successful inference requests per stage, by tower",
            ["tower", "stage"],
            registry=r,
        )
        self.model_items = Counter(
            "clipserve_model_items",
            "Items of the successful inference requests",
            ["tower"],
            registry=r,
        )
        self.model_last_inference = Gauge(
            "clipserve_model_last_inference_seconds",
            "When the tower last answered an inference (Unix time)",
            ["tower"],
            registry=r,
            multiprocess_mode="max",
        )
        # By tower: a --self-check warn server below a floor serves anyway (an alert's case).
        self.self_check_min_cosine = Gauge(
            "clipserve_self_check_min_cosine",
            "The startup self-check's worst cosine against the CPU FP32 reference",
            ["tower"],
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.self_check_floor = Gauge(
            "clipserve_self_check_floor",
            "The cosine the startup self-check asks of the tower's precision",
            ["tower"],
            registry=r,
            multiprocess_mode="mostrecent",
        )
        # Per executed batch size (at most --max-batch-size values per tower).
        self.batches = Counter(
            "clipserve_batches",
            "Batches computed, by tower and size",
            ["tower", "size"],
            registry=r,
        )
        self.batch_seconds = Counter(
            "clipserve_batch_seconds",
            "Device time of the batches computed, by tower and size",
            ["tower", "size"],
            registry=r,
        )

    def observe_batch(
        self, device: str, size: int, seconds: float, kind: TowerKind = "image"
    ) -> None:
        self.count_items(size, kind)
        self.batches.labels(kind, str(size)).inc()
        self.batch_seconds.labels(kind, str(size)).inc(seconds)
        if kind == "text":
            self.text_batch_size.observe(size)
            return
        self.batch_size.observe(size)
        self.batch_duration.labels(device).observe(seconds)

    def count_items(self, n: int, kind: TowerKind = "image") -> None:
        """Items computed by a batch that is not observed whole (part of it failed)."""
        (self.text_items if kind == "text" else self.items).inc(n)

    def add_scrape_time_gauges(
        self,
        queue_depth: Callable[[], Mapping[str, int]],
        admitted: Callable[[], Mapping[str, int]],
        device_memory: Callable[[], Mapping[str, int]],
        workers_alive: Callable[[], Mapping[str, bool]],
        estimated_wait: Callable[[], float],
    ) -> None:
        """`queue_depth` and `admitted` map each tower (image, text) to its items."""
        gauges = _ScrapeTimeGauges(
            queue_depth, admitted, device_memory, workers_alive, estimated_wait
        )
        self._gauges.append(gauges)
        self.registry.register(gauges)

    def _all(self) -> CollectorRegistry:
        if not self.multiprocess:
            return self.registry
        self.deferred.flush()  # this process's files first
        registry = CollectorRegistry()  # every process's files, summed, and this one's gauges
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        for gauges in self._gauges:
            registry.register(gauges)
        return registry

    def render(self) -> bytes:
        return generate_latest(self._all())

    def samples(self, *names: str) -> Iterator[Sample]:
        """The samples of the metrics `names` (their sample names: `_total` for counters), as
        /metrics shows them: summed over every process under --workers N."""
        wanted = set(names)
        for family in self._all().collect():
            for sample in family.samples:
                if sample.name in wanted:
                    yield sample


# ---- access: API keys and their quotas (http/access.py) ------------------------------------


def rate_limited_counter(registry: CollectorRegistry) -> Counter:
    """Requests answered 429 by a quota, by key: names from the key file only, an unnamed key
    as `sha256:` and its digest's first 8 hex digits, `anonymous` without a key file (so the
    label set is as small as the file)."""
    return Counter(
        "clipserve_rate_limited",
        "Requests refused by a key's rate limit (--rate-limit, --api-keys)",
        ["key"],
        registry=registry,
    )
