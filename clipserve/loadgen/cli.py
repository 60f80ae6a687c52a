"""`clipserve-bench`: drive a clipserve deployment and say where the milliseconds went.

clipserve-bench --url http://127.0.0.1:8000 --concurrency 1,8,32 --duration 10
clipserve-bench --rate 100,200 --arrivals poisson --payload raw-tensor --images-per-request 8
clipserve-bench report [--quick]     # the whole benchmark report into bench/results/
clipserve-bench ceiling              # this tool's own ceiling, side by side with wrk
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from clipserve.loadgen.images import load_images, parse_size
from clipserve.loadgen.loadgen import LoadSpec, run_async
from clipserve.loadgen.output import csv_text, details, plot, table, write_json
from clipserve.loadgen.payloads import ACCEPT, KINDS, NO_CACHE, ModelInput, build_requests
from clipserve.loadgen.runner import PointResult, run_point
from clipserve.loadgen.server import fetch_info


def _numbers(text: str, cast: type[float] | type[int]) -> list[float] | list[int]:
    try:
        return [cast(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="clipserve-bench",
        usage="%(prog)s [options]\n       %(prog)s report [--quick] [--out DIR] [--sections S,...]"
        "\n       %(prog)s ceiling [--rounds N] [--seconds S] [--json PATH]",
        description="Load generator for clipserve: closed loop (--concurrency) or open loop "
        "(--rate), latency from each request's intended send time, HDR percentiles, and the "
        "server's own breakdown from /metrics. Subcommands: 'report' (the whole benchmark "
        "report), 'ceiling' (this tool against wrk on a trivial endpoint).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    load = p.add_argument_group("load")
    load.add_argument(
        "--concurrency",
        "-c",
        type=lambda s: _numbers(s, int),
        metavar="N[,N...]",
        help="closed loop: clients sending back to back; a list sweeps (1,8,32)",
    )
    load.add_argument(
        "--rate",
        "-r",
        type=lambda s: _numbers(s, float),
        metavar="R[,R...]",
        help="open loop: requests/s whatever the server does; a list sweeps",
    )
    load.add_argument(
        "--arrivals",
        choices=("poisson", "constant"),
        default="poisson",
        help="open loop: inter-arrival times",
    )
    load.add_argument(
        "--duration", "-d", type=float, default=10.0, help="seconds measured per load point"
    )
    load.add_argument(
        "--warmup",
        type=float,
        default=2.0,
        help="seconds of load before each measured window, not recorded",
    )
    load.add_argument(
        "--requests",
        "-n",
        type=int,
        metavar="N",
        help="measure exactly N requests per point instead of --duration",
    )
    load.add_argument("--timeout", type=float, default=60.0, help="per-request timeout (s)")
    load.add_argument(
        "--connections",
        type=int,
        default=0,
        help="client connection pool; 0 = the concurrency, or 1000 open loop",
    )
    load.add_argument(
        "--procs", type=int, default=1, help="client processes sharing the load (results merged)"
    )
    load.add_argument("--seed", type=int, default=0, help="open loop: the arrival times' seed")
    body = p.add_argument_group("requests")
    body.add_argument(
        "--payload", "-p", default="jpeg", choices=list(KINDS), help="wire format (--list-payloads)"
    )
    body.add_argument("--list-payloads", action="store_true", help="describe each and exit")
    body.add_argument("--images", type=Path, help="a directory of images to send")
    body.add_argument(
        "--image-size",
        default="640x480",
        help="synthetic images when --images is not given: WIDTHxHEIGHT",
    )
    body.add_argument(
        "--images-per-request",
        "-b",
        type=int,
        default=1,
        metavar="N",
        help="images (or texts) per request, for the list formats",
    )
    body.add_argument(
        "--tensor-dtype",
        default="uint8",
        choices=("uint8", "float16", "float32"),
        help="tensor payloads: uint8 NHWC crops or normalised NCHW floats",
    )
    body.add_argument(
        "--accept", default="json", choices=list(ACCEPT), help="response format asked for"
    )
    body.add_argument(
        "--use-cache",
        action="store_true",
        help="let the server answer the repeated images from its embedding cache (by default "
        "each request says Cache-Control: no-cache, so the model is measured, not the cache)",
    )
    out = p.add_argument_group("output")
    out.add_argument("--json", type=Path, help="write every result (with HDR histograms)")
    out.add_argument("--csv", type=Path, help="write one row per load point")
    out.add_argument("--plot", type=Path, help="PNG: latency vs throughput, batch vs load")
    out.add_argument(
        "--usd-per-hour",
        type=float,
        help="what the server costs per hour: adds cost per million images",
    )
    out.add_argument("--quiet", "-q", action="store_true", help="no live progress line")
    return p


def specs(args: argparse.Namespace) -> list[LoadSpec]:
    common = dict(
        duration_s=args.duration,
        warmup_s=args.warmup,
        requests=args.requests,
        timeout_s=args.timeout,
        connections=args.connections,
        seed=args.seed,
        arrivals=args.arrivals,
    )
    if args.concurrency and args.rate:
        raise ValueError("give --concurrency or --rate, not both")
    if args.rate:
        return [LoadSpec(rate=float(r), **common) for r in args.rate]
    return [LoadSpec(concurrency=int(c), **common) for c in (args.concurrency or [1])]


def run(args: argparse.Namespace) -> int:
    if args.list_payloads:
        for k in KINDS.values():
            print(f"{k.name:<16} {k.help}")
        return 0
    try:
        points = specs(args)
        if args.procs < 1:
            raise ValueError("--procs must be at least 1")
        info = run_async(fetch_info(args.url))
        if info is None:
            print(
                f"warning: no /info from {args.url}; assuming a 224x224 CLIP input", file=sys.stderr
            )
        model = ModelInput.from_info(info or {})
        n = args.images_per_request
        sources = load_images(args.images, parse_size(args.image_size), min(64, max(8, n * 8)))
        requests = build_requests(
            args.payload,
            sources,
            model,
            images_per_request=n,
            tensor_dtype=args.tensor_dtype,
            accept=ACCEPT[args.accept],
            extra_headers={} if args.use_cache else NO_CACHE,
        )
    except ValueError as e:
        print(f"clipserve-bench: {e}", file=sys.stderr)
        return 2
    results: list[PointResult] = []
    for spec in points:
        results.append(
            run_point(
                args.url,
                requests,
                spec,
                procs=args.procs,
                progress=not args.quiet,
                usd_per_hour=args.usd_per_hour,
            )
        )
    size = f"{len(requests[0].body):,} B/request"
    print(
        f"{args.url}  payload {args.payload} x {requests[0].items} ({size}), "
        f"{points[0].mode} loop, window {results[0].window_s:g} s, latencies in ms"
    )
    print(table(results))
    for r in results:
        if text := details(r):
            print(text)
    meta = {
        "url": args.url,
        "payload": args.payload,
        "items_per_request": requests[0].items,
        "request_bytes": len(requests[0].body),
        "argv": sys.argv[1:],
    }
    if args.json:
        write_json(args.json, meta, results)
    if args.csv:
        args.csv.write_text(csv_text(results))
    if args.plot and not plot(args.plot, results, f"{args.url} {args.payload}"):
        print("warning: no matplotlib: pip install 'clipserve[bench]'", file=sys.stderr)
    return 0 if any(r.ok for r in results) else 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["report"]:
        from clipserve.loadgen.report import main as report_main

        return report_main(argv[1:])
    if argv[:1] == ["ceiling"]:
        from clipserve.loadgen.ceiling import main as ceiling_main

        return ceiling_main(argv[1:])
    return run(build_parser().parse_args(argv))
