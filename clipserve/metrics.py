"""Prometheus metrics, owned by the app (a fresh registry per app, so tests never share state).

With --workers N every process (engine, front ends) writes its counters and histograms to files
under PROMETHEUS_MULTIPROC_DIR (the client library's multiprocess mode) and any front end's
/metrics sums them; the scrape-time gauges come from the engine's pushed status instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

STAGES = ("receive", "decode", "queue", "compute", "encode")
_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class _ScrapeTimeGauges(Collector):
    """Values read when Prometheus scrapes, not kept up to date on the hot path."""

    def __init__(
        self,
        queue_depth: Callable[[], Mapping[str, int]],
        device_memory: Callable[[], Mapping[str, int]],
        workers_alive: Callable[[], Mapping[str, bool]],
        estimated_wait: Callable[[], float],
    ) -> None:
        self.queue_depth = queue_depth
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


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.multiprocess = "PROMETHEUS_MULTIPROC_DIR" in os.environ
        self._gauges: list[Collector] = []
        r = self.registry
        self.requests = Counter(
            "clipserve_requests", "HTTP requests", ["route", "status"], registry=r
        )
        self.request_duration = Histogram(
            "clipserve_request_duration_seconds", "Whole request time", ["route"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.stage_duration = Histogram(
            "clipserve_stage_duration_seconds", "Time per request stage", ["stage", "protocol"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch_size = Histogram(
            "clipserve_batch_size", "Images per forward pass", buckets=_BATCH_BUCKETS, registry=r
        )
        self.batch_duration = Histogram(
            "clipserve_batch_duration_seconds", "Forward pass time per batch", ["device"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.text_batch_size = Histogram(
            "clipserve_text_batch_size", "Texts per text-tower forward pass",
            buckets=_BATCH_BUCKETS, registry=r,
        )  # fmt: skip
        self.items = Counter("clipserve_items", "Images embedded", registry=r)
        self.text_items = Counter("clipserve_text_items", "Texts embedded", registry=r)
        self.device_busy = Counter(
            "clipserve_device_busy_seconds", "Device time spent on image batches (overlapping "
            "batches counted once); its rate is the busy fraction", ["device"], registry=r,
        )  # fmt: skip
        self.batch_failures = Counter(
            "clipserve_batch_failures", "Batches failed by the executor", ["device"], registry=r
        )
        self.batch_retries = Counter(
            "clipserve_batch_retries", "Sub-batches run again after a batch failed (bisection)",
            ["device"], registry=r,
        )  # fmt: skip
        self.expired_items = Counter(
            "clipserve_expired_items", "Queued items dropped unstarted: their deadline came first",
            ["kind"], registry=r,
        )  # fmt: skip
        self.request_bytes = Counter(
            "clipserve_request_bytes", "Request body bytes", ["protocol"], registry=r
        )
        self.response_bytes = Counter(
            "clipserve_response_bytes", "Response body bytes", ["protocol"], registry=r
        )

    def observe_batch(self, device: str, size: int, seconds: float, kind: str = "image") -> None:
        self.count_items(size, kind)
        if kind == "text":
            self.text_batch_size.observe(size)
            return
        self.batch_size.observe(size)
        self.batch_duration.labels(device).observe(seconds)

    def count_items(self, n: int, kind: str = "image") -> None:
        """Items computed by a batch that is not observed whole (part of it failed)."""
        (self.text_items if kind == "text" else self.items).inc(n)

    def add_scrape_time_gauges(
        self,
        queue_depth: Callable[[], Mapping[str, int]],
        device_memory: Callable[[], Mapping[str, int]],
        workers_alive: Callable[[], Mapping[str, bool]],
        estimated_wait: Callable[[], float],
    ) -> None:
        """`queue_depth` maps each tower (image, text) to what it has queued."""
        gauges = _ScrapeTimeGauges(queue_depth, device_memory, workers_alive, estimated_wait)
        self._gauges.append(gauges)
        self.registry.register(gauges)

    def render(self) -> bytes:
        if not self.multiprocess:
            return generate_latest(self.registry)
        registry = CollectorRegistry()  # every process's files, summed, and this one's gauges
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        for gauges in self._gauges:
            registry.register(gauges)
        return generate_latest(registry)
