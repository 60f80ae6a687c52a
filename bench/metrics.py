"""A server's /metrics, scraped and summed: what the benchmarks read from clipserve itself."""

from __future__ import annotations

import urllib.request

from clipserve.loadgen.server import Samples, parse_metrics


def scrape(url: str) -> Samples:
    """The Prometheus samples of the server at `url` now."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return parse_metrics(r.read().decode())


def total(samples: Samples | None, name: str, **labels: str) -> float:
    """The sum of `name`'s samples over its label sets (those that have `labels`)."""
    return sum(
        v
        for (n, have), v in (samples or {}).items()
        if n == name and labels.items() <= dict(have).items()
    )


def has(samples: Samples, name: str) -> bool:
    return any(n == name for n, _ in samples)
