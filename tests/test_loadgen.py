"""The benchmark load generator against a real server: closed and open loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from bench.loadgen import Request, percentiles, run_load
from tests.conftest import RunningServer, png_bytes, random_pixels

Serve = Callable[..., RunningServer]


def test_percentiles() -> None:
    stats = percentiles([0.001 * i for i in range(1, 101)])
    assert stats["p50"] == 50.5 and stats["max"] == 100.0 and stats["p99"] > stats["p90"]
    assert percentiles([]) == {}


def test_closed_and_open_loop(serve: Serve) -> None:
    server = serve(backend="fake", backend_option=["latency_ms=20"], max_batch_size=4)
    req = Request(png_bytes(random_pixels(0)), "image/png")
    closed = asyncio.run(run_load(server.url, req, concurrency=4, duration_s=1.0))
    assert closed.ok == closed.requests > 10 and closed.statuses == {"200": closed.ok}
    assert closed.mean_batch_size is not None and closed.mean_batch_size > 1  # 4 clients batch
    assert set(closed.server_timing_ms) == {"receive", "decode", "queue", "compute", "encode"}
    assert closed.latency_ms["p50"] >= 20  # at least the simulated device time

    opened = asyncio.run(run_load(server.url, req, rate=40, duration_s=1.0))
    assert opened.mode == "open" and 12 <= opened.requests <= 80  # Poisson, mean 40 (±4 sd)
    assert opened.ok == opened.requests
