"""Offline executor benchmark, no HTTP: images/s and latency per batch size, device memory.

Each executor is built, warmed up and timed on its own device thread, exactly as the server
runs it. Writes bench/results/executors-<device>.json and prints a markdown table.

    python -m bench.executors [--backends torch,ort-cpu] [--gpus cpu] [--sizes 1,2,...,256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import add_model_flags, describe_model, machine, model_flags, utc_now
from clipserve.config import load_config
from clipserve.runtime import build_runtime


def measure(
    runtime: Any, sizes: list[int], min_time_s: float, min_runs: int
) -> list[dict[str, Any]]:
    executor, thread = runtime.executors[0], runtime.threads[0]
    h, w = executor.info.input_size
    rng = np.random.default_rng(0)

    def on_thread() -> list[dict[str, Any]]:
        rows = []
        for n in sizes:
            x = rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8)
            executor.run(x)  # first run at this size: allocator, kernels
            samples: list[float] = []
            start = time.perf_counter()
            while len(samples) < min_runs or time.perf_counter() - start < min_time_s:
                t0 = time.perf_counter()
                executor.run(x)
                samples.append(time.perf_counter() - t0)
            median = statistics.median(samples)
            rows.append({"batch": n, "images_per_s": round(n / median, 2),
                         "latency_ms": round(median * 1000, 2), "runs": len(samples),
                         "memory_bytes": executor.memory()})  # fmt: skip
            print(f"  batch {n:>3}: {n / median:8.1f} img/s  {median * 1000:8.1f} ms", flush=True)
        return rows

    return thread.submit(on_thread).result()  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_flags(parser)
    parser.add_argument("--backends", default="torch,ort-cpu,torch+compile")
    parser.add_argument("--sizes", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--min-time", type=float, default=2.0)
    parser.add_argument("--min-runs", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    results = []
    for variant in args.backends.split(","):
        backend, _, extra = variant.partition("+")
        flags = {**model_flags(args), "backend": backend, "max_batch_size": str(max(sizes)),
                 "max_queue_size": str(max(sizes)), "max_items_per_request": "1"}  # fmt: skip
        if extra == "compile":
            flags["compile"] = "true"
        elif extra:
            flags["precision"] = extra
        print(f"{variant} ...", flush=True)
        t0 = time.perf_counter()
        runtime = build_runtime(load_config(flags, environ={}))
        startup = time.perf_counter() - t0
        info = runtime.executors[0].info
        try:
            rows = measure(runtime, sizes, args.min_time, args.min_runs)
        finally:
            runtime.close()
        results.append({"variant": variant, "backend": info.backend, "device": info.device,
                        "precision": info.precision, "startup_s": round(startup, 1),
                        "rows": rows})  # fmt: skip
    doc = {
        "benchmark": "executors",
        "machine": machine(),
        "device": args.gpus,
        "model": describe_model(args),
        "input": "uint8 NHWC 224x224, normalised on the executor's device",
        "time": utc_now(),
        "results": results,
    }
    out = args.out or Path(f"bench/results/executors-{args.gpus.replace(',', '_')}.json")
    out.write_text(json.dumps(doc, indent=2) + "\n")
    header = "| batch | " + " | ".join(f"{r['variant']} img/s (ms)" for r in results) + " |"
    print(header)
    print("|---" * (len(results) + 1) + "|")
    for i, n in enumerate(sizes):
        cells = [f"{r['rows'][i]['images_per_s']} ({r['rows'][i]['latency_ms']})" for r in results]
        print(f"| {n} | " + " | ".join(cells) + " |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
