"""Triton's perf_analyzer and clipserve-bench on the same load against the same server.

One `clipserve` (fake backend, the tiny model, no cache) serving HTTP and gRPC; each tool keeps
the same number of requests in flight, each request one UINT8 [1, 224, 224, 3] tensor, in
interleaved rounds with the order rotated:

- `perf_analyzer-http`, `perf_analyzer-grpc`: `-m <model>-uint8` with random data;
- `perf_analyzer-grpc-shm`: the same with `--shared-memory system`;
- `clipserve-bench-http`: `-p kserve-tensor` (Triton's binary tensor extension over HTTP).

Needs `make perf-analyzer-env`. Writes requests per second per variant (median and spread).

    python -m bench.triton_tools --out bench/results/triton-tools.json   # 5 rounds of 5 s
"""

from __future__ import annotations

import argparse
import csv
import io
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import REPO, machine, rotated, spread, utc_now, write_report
from clipserve.loadgen.procs import clipserve_process, free_port, tiny_model

PERF_ANALYZER = REPO / ".perf-analyzer" / "perf_analyzer"
VARIANTS = (
    "perf_analyzer-http",
    "perf_analyzer-grpc",
    "perf_analyzer-grpc-shm",
    "clipserve-bench-http",
)
MODEL = "tiny-clip"


def perf_analyzer(url: str, protocol: str, shm: bool, concurrency: int, seconds: float) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.csv"
        cmd = [str(PERF_ANALYZER), "-m", MODEL + "-uint8", "-u", url, "-i", protocol]
        cmd += ["--concurrency-range", str(concurrency), "-f", str(report)]
        cmd += ["--measurement-interval", str(int(seconds * 1000)), "--stability-percentage", "50"]
        if shm:
            cmd += ["--shared-memory", "system"]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if run.returncode != 0:
            raise RuntimeError(run.stdout[-2000:] + run.stderr[-2000:])
        rows = list(csv.DictReader(io.StringIO(report.read_text())))
    Path("/dev/shm/embedding").unlink(missing_ok=True)  # perf_analyzer may leave its output
    return float(rows[0]["Inferences/Second"])


def clipserve_bench(url: str, concurrency: int, seconds: float) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.csv"
        cmd = [str(Path(sys.executable).parent / "clipserve-bench"), "--url", url]
        cmd += ["-p", "kserve-tensor"]
        cmd += ["-c", str(concurrency), "-d", str(seconds), "--warmup", "1", "--csv", str(out)]
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)
        rows = list(csv.DictReader(io.StringIO(out.read_text())))
    return float(rows[0]["req/s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not PERF_ANALYZER.exists():
        sys.exit(f"no {PERF_ANALYZER}: run make perf-analyzer-env")
    runs: dict[str, list[float]] = {v: [] for v in VARIANTS}
    grpc_port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["--backend", "fake", "--model", str(tiny_model(Path(tmp))), "--pretrained"]
        flags += ["none", "--gpus", "cpu", "--cache-mb", "0", "--grpc-port", str(grpc_port)]
        flags += ["--log-level", "warning", "--shm-max-regions", "8"]  # perf_analyzer-grpc-shm
        with clipserve_process(flags) as (_, url):
            grpc_url, http_url = f"127.0.0.1:{grpc_port}", url.removeprefix("http://")
            for r in range(args.rounds):
                for variant in rotated(VARIANTS, r):
                    c, s = args.concurrency, args.seconds
                    if variant == "clipserve-bench-http":
                        rate = clipserve_bench(url, c, s)
                    elif variant == "perf_analyzer-http":
                        rate = perf_analyzer(http_url, "http", False, c, s)
                    else:
                        rate = perf_analyzer(grpc_url, "grpc", variant.endswith("shm"), c, s)
                    runs[variant].append(round(rate, 1))
                    print(f"round {r + 1} {variant}: {rate:.1f} req/s", flush=True)
    base = runs["perf_analyzer-http"]
    report = {
        "benchmark": "triton_tools",
        "when": utc_now(),
        "machine": machine(),
        "what": (
            "clipserve --backend fake (tiny model, --cache-mb 0), HTTP and gRPC; "
            f"{args.concurrency} requests in flight, one UINT8 [1, 224, 224, 3] tensor each, "
            f"{args.seconds:g} s per variant per round; the tools share the machine's 2 cores "
            "with the server"
        ),
        "rounds": args.rounds,
        "requests_per_s": {v: spread(runs[v], 1) for v in VARIANTS},
        "ratio_to_perf_analyzer_http": {
            v: spread([b / a for a, b in zip(base, runs[v], strict=True)], 2)
            for v in VARIANTS
            if v != "perf_analyzer-http"
        },
        "runs": runs,
    }
    write_report(report, args.out)


if __name__ == "__main__":
    main()
