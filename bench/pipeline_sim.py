"""The pipelined device worker on a simulated GPU, through the real server.

The fake backend with `stream=1` behaves as a GPU stream: a batch is launched at once and
completes `latency_ms` (L) after the device frees, in order, its sleep releasing the GIL as a
kernel would. With batches of B images the device's ceiling is B/L. A sequential worker
(`--pipeline-depth 1`) adds the host's time per batch to every batch (taking it from the queue,
stacking, answering its futures, and the event loop's share of the HTTP work competing with
all that), so it serves B/(L + host); the pipelined worker (`--pipeline-depth 2`, 3) hides that
time behind the device's and should reach >= 0.95 x B/L.

Load: clipserve-bench's closed loop over real HTTP (aiohttp), uint8 tensors in msgpack with
several images per request and msgpack answers, enough clients to keep the queue above B. B
and L are chosen so the front end (2 cores here, shared with the client) is not the limit.
Rounds interleave the depths; the result is each depth's median with its spread.

    python -m bench.pipeline_sim --out bench/results/pipeline-sim.json     # ~4 minutes
    python -m bench.pipeline_sim --rounds 1 --seconds 4                    # a quick look
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from bench.common import machine, spread, utc_now
from clipserve.loadgen.images import load_images
from clipserve.loadgen.loadgen import LoadSpec
from clipserve.loadgen.payloads import ModelInput, build_requests
from clipserve.loadgen.procs import free_port, stop, tiny_model, wait_ready
from clipserve.loadgen.runner import run_point


def serve_main(argv: list[str]) -> int:
    """The server process: `clipserve` itself, its DeviceWorkers' depth defaulting to
    --pipeline-depth too, so the run is right whether or not this tree's Batcher passes it."""
    from clipserve.batching.worker import DeviceWorker
    from clipserve.cli import main

    depth = int(argv[argv.index("--pipeline-depth") + 1])
    defaults = DeviceWorker.__init__.__kwdefaults__
    assert defaults is not None
    defaults["pipeline_depth"] = depth
    return main(argv)


def start_server(flags: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "bench.pipeline_sim", "--serve", *flags]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, 120, "server")
    except RuntimeError:
        stop(proc)
        raise
    return proc, url


def server_flags(model: Path, args: argparse.Namespace, depth: int) -> list[str]:
    flags = ["--model", str(model), "--pretrained", "none", "--backend", "fake", "--gpus", "0"]
    for option in (f"latency_ms={args.latency_ms}", "stream=1", "compute=0"):
        flags += ["--backend-option", option]
    flags += ["--max-batch-size", str(args.batch), "--max-queue-size", str(args.batch * 16)]
    flags += ["--max-items-per-request", str(args.images_per_request)]
    return [*flags, "--pipeline-depth", str(depth)]


def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/info", timeout=5) as r:
        info = json.loads(r.read())
    model = ModelInput.from_info(info)
    sources = load_images(None, (256, 256), 8)
    requests = build_requests(
        "msgpack-tensor",
        sources,
        model,
        images_per_request=args.images_per_request,
        accept="application/msgpack",
    )
    spec = LoadSpec(concurrency=args.concurrency, duration_s=args.seconds, warmup_s=2.0)
    point = run_point(url, requests, spec)
    server = point.server or {}
    return {
        "images_per_s": point.images_per_s,
        "requests_per_s": point.requests_per_s,
        "ok": point.ok,
        "completed": point.completed,
        "latency_ms": {k: point.latency_ms.get(k) for k in ("p50", "p99")},
        "server": server,
        "warnings": point.warnings,
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        sys.exit(serve_main(sys.argv[2:]))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32, help="B: --max-batch-size")
    p.add_argument("--latency-ms", type=float, default=30.0, help="L: device time per batch")
    p.add_argument("--images-per-request", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=16, help="closed-loop clients")
    p.add_argument("--depths", default="1,2,3")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=10.0, help="measured window per point")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    ceiling = args.batch / (args.latency_ms / 1000)
    runs: dict[int, list[dict[str, Any]]] = {d: [] for d in depths}
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp))
        for r in range(args.rounds):
            for depth in depths if r % 2 == 0 else reversed(depths):  # interleaved rounds
                proc, url = start_server(server_flags(model, args, depth))
                try:
                    result = measure(url, args)
                finally:
                    stop(proc)
                runs[depth].append(result)
                rate = result["images_per_s"]
                print(
                    f"round {r + 1} depth {depth}: {rate:.1f} img/s ({rate / ceiling:.3f} of B/L)",
                    flush=True,
                )
    per_depth = {}
    for depth, results in runs.items():
        rates = [x["images_per_s"] for x in results]
        per_depth[str(depth)] = {
            "images_per_s": spread(rates, 1),
            "of_ceiling": round(statistics.median(rates) / ceiling, 3),
            "runs": results,
        }
    seq = statistics.median(x["images_per_s"] for x in runs[min(depths)])
    host_ms = (args.batch / seq - args.latency_ms / 1000) * 1000 if seq else None
    out = {
        "benchmark": "pipeline-sim",
        "when": utc_now(),
        "machine": machine(),
        "setup": {
            "batch": args.batch,
            "latency_ms": args.latency_ms,
            "ceiling_images_per_s": round(ceiling, 1),
            "payload": f"msgpack-tensor, {args.images_per_request} uint8 224x224x3 per request, "
            "msgpack answers",
            "concurrency": args.concurrency,
            "rounds": args.rounds,
            "seconds": args.seconds,
            "backend": "fake, stream=1 (simulated GPU stream), compute=0",
        },
        "host_ms_per_batch_from_sequential": round(host_ms, 2) if host_ms else None,
        "depths": per_depth,
    }
    text = json.dumps(out, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    for depth in depths:
        d = per_depth[str(depth)]
        print(f"depth {depth}: {d['images_per_s']} img/s, {d['of_ceiling']} of B/L = {ceiling:g}")


if __name__ == "__main__":
    main()
