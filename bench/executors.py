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


def executor_flags(model: dict[str, str], variant: str, sizes: list[int]) -> dict[str, str]:
    """The server flags of one variant, `backend[+precision][+compile]` (say torch+fp16+compile),
    with room for the largest of `sizes` in one batch, one image per request."""
    backend, *extras = variant.split("+")
    largest = str(max(sizes))
    flags = {**model, "backend": backend, "max_batch_size": largest, "max_queue_size": largest}
    flags["max_items_per_request"] = "1"
    for extra in extras:
        if extra == "compile":
            flags["compile"] = "true"
        else:
            flags["precision"] = extra
    return flags


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
        flags = executor_flags(model_flags(args), variant, sizes)
        print(f"{variant} ...", flush=True)
        result = measure_executor(flags, sizes, min_time_s=args.min_time, min_runs=args.min_runs)
        results.append({"variant": variant, **result})
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
