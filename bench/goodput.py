"""Goodput under overload: images answered 200 within their deadline, per second of capacity.

The fake executor sleeps a fixed time per image (per_item_ms) and then computes its features
with numpy (a few ms per image more on a busy machine). Capacity is its rate at full batches,
timed by calling it directly before each level; the rate of the sleep alone (1000 / per_item_ms)
is reported too. Open-loop Poisson arrivals offer 2x, 4x and 8x capacity, for JPEG (one image
per request) and raw uint8 tensors (4 per request), with --request-timeout-s 2 (admission bound
by the deadline) and 30 (bound by --max-queue-size). Per level it reports:
  goodput        images answered 200 within the timeout per second, over capacity, counted in
                 a window that skips the first seconds (the queue filling up)
  hung           requests with no answer 10 s after the server's timeout (must be 0)
  503 p99        latency of refusals, from each request's scheduled start (target < 50 ms)
  computed       images the executor ran (clipserve_items_total) against images answered 200
The server runs in a subprocess on this machine, as clients do; client and server share it.

    python -m bench.goodput --out bench/results/goodput.json   # the full run, ~6 minutes
    python -m bench.goodput --quick                            # 2x and 8x, 2 s timeout
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench.common import machine, timed, utc_now
from bench.metrics import scrape, total
from clipserve.backends.fake import FakeExecutor
from clipserve.inference.preprocess import PreprocessSpec
from clipserve.loadgen.images import jpeg
from clipserve.loadgen.procs import clipserve_server, tiny_model

TENSOR_IMAGES = 4  # images per raw-tensor request
# What each level prints as it ends.
PROGRESS = (
    "protocol",
    "request_timeout_s",
    "overload",
    "goodput_over_capacity",
    "hung",
    "latency_503_ms",
    "computed_over_answered",
    "statuses",
)


@dataclass
class Payload:
    name: str
    body: bytes
    headers: dict[str, str]
    images: int


def payloads() -> dict[str, Payload]:
    pixels = np.random.default_rng(0).integers(0, 256, (TENSOR_IMAGES, 224, 224, 3), np.uint8)
    shape = ",".join(map(str, pixels.shape))
    return {
        "jpeg": Payload("jpeg", jpeg(320, 240), {"Content-Type": "image/jpeg"}, 1),
        "raw-uint8-tensor": Payload(
            "raw-uint8-tensor",
            pixels.tobytes(),
            {
                "Content-Type": "application/octet-stream",
                "X-Tensor-Dtype": "uint8",
                "X-Tensor-Shape": shape,
            },
            TENSOR_IMAGES,
        ),
    }


@dataclass
class Answer:
    scheduled: float  # perf_counter when the request was due
    sent: float  # when the client got to send it (later, if the client lagged)
    done: float
    status: str  # HTTP status, or the client error's name (a hung or broken request)
    retry_after: int | None = None


async def send(session: aiohttp.ClientSession, url: str, p: Payload, scheduled: float) -> Answer:
    sent = time.perf_counter()
    retry_after = None
    try:
        async with session.post(url + "/embed", data=p.body, headers=p.headers) as r:
            await r.read()
            status = str(r.status)
            if "Retry-After" in r.headers:
                retry_after = int(r.headers["Retry-After"])
    except (aiohttp.ClientError, TimeoutError) as e:
        status = type(e).__name__
    return Answer(scheduled, sent, time.perf_counter(), status, retry_after)


async def open_loop(
    url: str, p: Payload, rate: float, duration_s: float, client_timeout_s: float, seed: int
) -> tuple[list[Answer], float]:
    """Poisson arrivals at `rate` requests/s for duration_s; every answer awaited."""
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=client_timeout_s)
    rng = random.Random(seed)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        scheduled, end = start, start + duration_s
        tasks = []
        while scheduled < end:
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(session, url, p, scheduled)))
            scheduled += rng.expovariate(rate)
        answers = await asyncio.gather(*tasks)
    return answers, start


def executor_capacity(per_item_ms: float, batch: int, repeat: int = 3) -> float:
    """Images/s of the fake executor itself at full batches, called directly here."""
    spec = PreprocessSpec((224, 224), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    fake = FakeExecutor(spec, 32, per_item_ms=per_item_ms)
    images = np.random.default_rng(0).integers(0, 256, (batch, 224, 224, 3), np.uint8)
    return batch / float(np.median(timed(lambda: fake.run(images), repeat)))


def pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 1) if values else None


def measure(
    url: str,
    p: Payload,
    level: float,
    capacity: float,
    nominal: float,
    timeout_s: float,
    duration_s: float,
    skip_s: float,
    seed: int,
) -> dict[str, Any]:
    rate = level * capacity / p.images
    before = scrape(url)
    answers, start = asyncio.run(open_loop(url, p, rate, duration_s, timeout_s + 10, seed))
    time.sleep(0.5)  # let the last answers be counted
    after = scrape(url)

    def delta(name: str, **labels: str) -> float:
        """The change of a metric, summed over its label sets (those with `labels`)."""
        return total(after, name, **labels) - total(before, name, **labels)

    # The server's deadline runs from when the request reaches it: a 200 counts if it came
    # within the timeout of being sent. Latencies below are from the scheduled start, which
    # also charges the time this (shared, 2-core) client lagged behind its schedule.
    ok = [a for a in answers if a.status == "200" and a.done - a.sent <= timeout_s]
    late = sum(1 for a in answers if a.status == "200" and a.done - a.scheduled > timeout_s)
    window = (start + skip_s, start + duration_s)
    in_window = sum(p.images for a in ok if window[0] <= a.done < window[1])
    goodput = in_window / (window[1] - window[0])
    refused = [a for a in answers if a.status == "503"]
    statuses: dict[str, int] = {}
    for a in answers:
        statuses[a.status] = statuses.get(a.status, 0) + 1
    answered = len(ok) * p.images
    computed = delta("clipserve_items_total")
    retry_after = [a.retry_after for a in refused if a.retry_after is not None]
    return {
        "protocol": p.name,
        "images_per_request": p.images,
        "request_timeout_s": timeout_s,
        "overload": level,
        "offered_images_per_s": round(rate * p.images, 1),
        "requests": len(answers),
        "statuses": statuses,
        "goodput_images_per_s": round(goodput, 2),
        "capacity_images_per_s": round(capacity, 2),
        "goodput_over_capacity": round(goodput / capacity, 3),
        "goodput_over_sleep_only_capacity": round(goodput / nominal, 3),
        "hung": sum(1 for a in answers if not a.status.isdigit()),
        "ok_but_late_from_schedule": late,
        "client_lag_ms_p99": pct([a.sent - a.scheduled for a in answers], 99),
        "latency_503_ms": {
            "p50": pct([a.done - a.scheduled for a in refused], 50),
            "p99": pct([a.done - a.scheduled for a in refused], 99),
            "p99_from_send": pct([a.done - a.sent for a in refused], 99),
        },
        "latency_200_ms": {
            "p50": pct([a.done - a.scheduled for a in ok], 50),
            "p99": pct([a.done - a.scheduled for a in ok], 99),
        },
        "retry_after_s": [min(retry_after), max(retry_after)] if retry_after else None,
        "images_computed": int(computed),
        "images_answered_200": answered,
        "computed_over_answered": round(computed / answered, 3) if answered else None,
        "expired_in_queue": int(delta("clipserve_expired_items_total", kind="image")),
        "device_busy_fraction": round(
            delta("clipserve_batch_duration_seconds_sum") / (time.perf_counter() - start),
            3,
        ),
        "mean_batch_ms": round(
            1000
            * delta("clipserve_batch_duration_seconds_sum")
            / max(delta("clipserve_batch_duration_seconds_count"), 1),
            1,
        ),
        "mean_batch_size": round(
            delta("clipserve_batch_size_sum") / max(delta("clipserve_batch_size_count"), 1), 2
        ),
    }


def server_flags(args: argparse.Namespace, model: Path, timeout_s: float) -> list[str]:
    flags = ["--backend", "fake", "--pretrained", "none", "--model", str(model)]
    flags += ["--backend-option", f"per_item_ms={args.per_item_ms}"]
    flags += ["--max-batch-size", str(args.max_batch_size)]
    flags += ["--max-queue-size", str(args.max_queue_size)]
    return [*flags, "--request-timeout-s", str(timeout_s)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2x and 8x, 2 s timeout, 6 s each")
    parser.add_argument("--levels", default="2,4,8")
    parser.add_argument("--timeouts", default="2,30")
    parser.add_argument("--protocols", default="jpeg,raw-uint8-tensor")
    parser.add_argument("--per-item-ms", type=float, default=40.0)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--max-queue-size", type=int, default=256)
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of load per level")
    parser.add_argument("--skip", type=float, default=3.0, help="seconds not counted at first")
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--server-tree", type=Path, help="serve from this source tree (before/after)"
    )
    args = parser.parse_args()
    if args.quick:
        args.levels, args.timeouts, args.duration, args.skip = "2,8", "2", 6.0, 2.0
    nominal = 1000 / args.per_item_ms
    all_payloads = payloads()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        # The fake executor ignores the weights; the server needs the preprocessing and the
        # text tower it builds for every model.
        model = tiny_model(Path(tmp))
        for timeout_s in (float(t) for t in args.timeouts.split(",")):
            flags = server_flags(args, model, timeout_s)
            with clipserve_server(flags, startup_s=120, cwd=args.server_tree) as url:
                # two seconds at half capacity: the batcher measures its batch costs
                jpegs, client_timeout_s = all_payloads["jpeg"], timeout_s + 10
                asyncio.run(open_loop(url, jpegs, nominal / 2, 2.0, client_timeout_s, seed=0))
                for name in args.protocols.split(","):
                    for level in (float(x) for x in args.levels.split(",")):
                        capacity = executor_capacity(args.per_item_ms, args.max_batch_size)
                        row = measure(
                            url,
                            all_payloads[name],
                            level,
                            capacity,
                            nominal,
                            timeout_s,
                            args.duration,
                            args.skip,
                            seed=len(rows),
                        )
                        rows.append(row)
                        print(json.dumps({k: row[k] for k in PROGRESS}), flush=True)
    result = {
        "benchmark": "goodput under overload",
        "date": utc_now(),
        "machine": machine(),
        "note": "client and server share this machine's cores",
        "server": {
            "backend": f"fake, per_item_ms={args.per_item_ms}, one worker",
            "max_batch_size": args.max_batch_size,
            "max_queue_size": args.max_queue_size,
        },
        "sleep_only_capacity_images_per_s": nominal,
        "duration_s": args.duration,
        "window_skips_first_s": args.skip,
        "rows": rows,
        "worst": {
            "goodput_over_capacity": min(r["goodput_over_capacity"] for r in rows),
            "hung": sum(r["hung"] for r in rows),
            "latency_503_p99_ms": max((r["latency_503_ms"]["p99"] or 0) for r in rows),
        },
    }
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(json.dumps(result["worst"]))


if __name__ == "__main__":
    try:
        import uvloop  # the client's own overhead, on a machine it shares with the server

        uvloop.install()
    except ImportError:
        pass
    main()
