"""Executors timed offline (no HTTP), each on its own device thread as the server runs it."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np


def measure_executor(
    flags: Mapping[str, str],
    sizes: Sequence[int],
    *,
    min_time_s: float = 2.0,
    min_runs: int = 3,
    report: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Build the executor `flags` describe (server flag names), then images/s and median latency
    per batch size on uint8 NHWC input. Imports torch: run it where that is acceptable."""
    from clipserve.config import load_config
    from clipserve.inference.runtime import build_runtime

    t0 = time.perf_counter()
    runtime = build_runtime(load_config(dict(flags), environ={}))
    startup = time.perf_counter() - t0
    executor, thread = runtime.executors[0], runtime.threads[0]
    info = executor.info
    h, w = info.input_size
    rng = np.random.default_rng(0)

    def on_thread() -> list[dict[str, Any]]:
        rows = []
        for n in sizes:
            x = rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8)
            executor.run(x)  # first run at this size: allocator, kernels
            samples: list[float] = []
            start = time.perf_counter()
            while len(samples) < min_runs or time.perf_counter() - start < min_time_s:
                t = time.perf_counter()
                executor.run(x)
                samples.append(time.perf_counter() - t)
            median = statistics.median(samples)
            rows.append(
                {
                    "batch": n,
                    "images_per_s": round(n / median, 2),
                    "latency_ms": round(median * 1000, 2),
                    "runs": len(samples),
                    "memory_bytes": executor.memory(),
                }
            )
            report(f"  batch {n:>3}: {n / median:8.1f} img/s  {median * 1000:8.1f} ms")
        return rows

    try:
        rows = thread.submit(on_thread).result()
    finally:
        runtime.close()
    return {
        "backend": info.backend,
        "device": info.device,
        "precision": info.precision,
        "startup_s": round(startup, 1),
        "rows": rows,
    }
