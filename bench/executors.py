"""Offline executor benchmark, no HTTP: images/s and latency per batch size, device memory.

Each executor is built, warmed up and timed on its own device thread, exactly as the server
runs it. Writes bench/results/executors-<device>.json and prints a markdown table.

    python -m bench.executors [--backends torch,ort-cpu] [--gpus cpu] [--sizes 1,2,...,256]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import add_model_flags, describe_model, machine, model_flags, utc_now
from clipserve.loadgen.offline import measure_executor


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
        results.append({"variant": variant, **measure_executor(
            flags, sizes, min_time_s=args.min_time, min_runs=args.min_runs)})  # fmt: skip
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
