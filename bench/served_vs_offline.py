"""Served vs offline, in one run on one machine.

1. Offline, in this process: executor throughput at batch 32 on uint8 crops (model only, the
   denominator), decode+model throughput at batch 32, and decode+model latency for one image.
2. Served: `clipserve` with the same flags in a subprocess, driven over real HTTP by the
   closed-loop aiohttp load generator with 640x480 JPEGs at each concurrency.
Writes bench/results/served_vs_offline-<backend>-<device>.json.

    python -m bench.served_vs_offline [--model ViT-B-32] [--backend torch] [--gpus cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from bench.common import add_model_flags, describe_model, machine, model_flags, timed, utc_now
from clipserve.config import load_config
from clipserve.inference.runtime import build_runtime
from clipserve.loadgen.images import jpeg
from clipserve.loadgen.loadgen import LoadSpec
from clipserve.loadgen.payloads import Request
from clipserve.loadgen.procs import clipserve_server
from clipserve.loadgen.runner import run_point


class Offline:
    """The executor and decoder in this process, run on their device thread as the server does."""

    def __init__(self, flags: dict[str, str], images: list[bytes]) -> None:
        self.runtime = build_runtime(load_config(flags, environ={}))
        self.images = images
        self.crops = np.stack([self.runtime.decoder(d) for d in images])

    def measure(self, repeat: int) -> dict[str, float]:
        ex, decode, images = self.runtime.executors[0], self.runtime.decoder, self.images

        def on_device_thread(fn: object) -> list[float]:
            return self.runtime.threads[0].submit(fn).result()  # type: ignore[arg-type]

        model = on_device_thread(lambda: timed(lambda: ex.run(self.crops), repeat))
        both = on_device_thread(
            lambda: timed(lambda: ex.run(np.stack([decode(d) for d in images])), repeat)
        )
        one = on_device_thread(lambda: timed(lambda: ex.run(decode(images[0])[None]), repeat * 8))
        n = len(images)
        return {
            "model_only_images_per_s": round(n / statistics.median(model), 3),
            "decode_and_model_images_per_s": round(n / statistics.median(both), 3),
            "decode_and_model_batch1_ms": round(statistics.median(one) * 1000, 3),
        }

    @property
    def executor(self) -> str:
        info = self.runtime.executors[0].info
        return f"{info.backend}/{info.precision}/{info.device}"


# What each served point prints as it ends.
PROGRESS = (
    "concurrency",
    "images_per_s",
    "latency_ms",
    "mean_batch_size",
    "served_over_offline_model_only",
    "p50_over_offline_batch1",
)


def jpeg_request(data: bytes) -> Request:
    return Request("/embed", data, {"Content-Type": "image/jpeg"}, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_flags(parser)
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--precision")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--extra", default="", help="more server flags, space-separated")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    flags = {**model_flags(args), "backend": args.backend, "max_batch_size": "32"}
    if args.precision:
        flags["precision"] = args.precision
    server_args = [a for k, v in flags.items() for a in ("--" + k.replace("_", "-"), v)]
    server_args += args.extra.split()
    images = [jpeg(640, 480, seed=i) for i in range(32)]

    offline = Offline(flags, images)
    rounds: list[dict[str, object]] = []
    try:
        with clipserve_server(server_args) as url:
            run_point(url, [jpeg_request(images[0])], LoadSpec(concurrency=4, duration_s=3))
            # Rounds interleave offline and served measurements: this machine is shared and
            # noisy, so each ratio compares numbers taken minutes apart at most, and the median
            # is quoted.
            for index in range(args.rounds):
                off = offline.measure(args.repeat)
                print(f"round {index}: offline {off}", flush=True)
                served = []
                for c in (int(x) for x in args.concurrency.split(",")):
                    spec = LoadSpec(concurrency=c, duration_s=args.duration, warmup_s=1.0)
                    result = run_point(url, [jpeg_request(images[c % 32])], spec)
                    row = result.to_dict()
                    row["mean_batch_size"] = (result.server or {}).get("mean_batch_size")
                    row["served_over_offline_model_only"] = round(
                        result.images_per_s / off["model_only_images_per_s"], 3
                    )
                    row["p50_over_offline_batch1"] = round(
                        result.latency_ms["p50"] / off["decode_and_model_batch1_ms"], 3
                    )
                    served.append(row)
                    print({k: row[k] for k in PROGRESS}, flush=True)
                rounds.append({"offline": off, "served": served})
    finally:
        offline.runtime.close()

    summary = {}
    for c in (int(x) for x in args.concurrency.split(",")):
        rows = [r for rnd in rounds for r in rnd["served"] if r["concurrency"] == c]  # type: ignore[attr-defined]
        summary[f"c{c}"] = {
            key: statistics.median(float(r[key]) for r in rows)
            for key in ("images_per_s", "served_over_offline_model_only", "p50_over_offline_batch1")
        } | {
            "p50_ms": statistics.median(r["latency_ms"]["p50"] for r in rows),
            "p99_ms": statistics.median(r["latency_ms"]["p99"] for r in rows),
            "mean_batch_size": statistics.median(r["mean_batch_size"] or 0 for r in rows),
        }
    print(json.dumps(summary, indent=2))
    result_doc = {
        "benchmark": "served_vs_offline",
        "machine": machine(),
        "device": args.gpus,
        "model": describe_model(args),
        "input": "640x480 JPEG q90",
        "server_flags": server_args,
        "executor": offline.executor,
        "summary_medians": summary,
        "rounds": rounds,
        "time": utc_now(),
    }
    out = args.out or Path(f"bench/results/served_vs_offline-{args.backend}-{args.gpus}.json")
    out.write_text(json.dumps(result_doc, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
