"""A metric's labelled children, looked up once per label set.

`labels()` takes the metric's lock and builds a tuple on every call (~3 µs); a request asked for
twenty of them, the same few dozen combinations for ever. The label values are bounded sets
(routes as templates, statuses, stages, protocols, towers), so the cache is bounded too, and a
child is the object `labels()` returns, so the numbers are the same.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from prometheus_client.metrics import MetricWrapperBase

M = TypeVar("M", bound=MetricWrapperBase)


class Children(Generic[M]):
    """`children(*values)` is `metric.labels(*values)`, remembered."""

    def __init__(self, metric: M) -> None:
        self.metric = metric
        self._known: dict[tuple[str, ...], M] = {}

    def __call__(self, *values: str) -> M:
        child = self._known.get(values)
        if child is None:
            child = self._known[values] = self.metric.labels(*values)
        return child
