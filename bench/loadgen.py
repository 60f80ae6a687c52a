"""Load generator: closed loop (N clients back to back) and open loop (Poisson arrivals).

Built on aiohttp: an httpx client at concurrency 32 measures itself, not the server
(../shared/FACTS.md). Open-loop latency counts from each request's scheduled start, so a
stalled server is charged for the requests it kept waiting (no coordinated omission).

    python -m bench.loadgen --url http://127.0.0.1:8000 --image cat.jpg --concurrency 32
    python -m bench.loadgen --url ... --image cat.jpg --rate 20 --duration 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import numpy as np


@dataclass
class Request:
    body: bytes
    content_type: str
    accept: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)  # e.g. X-Tensor-Dtype, X-Tensor-Shape
    path: str = "/embed"


@dataclass
class LoadResult:
    mode: str  # closed | open
    concurrency: int | None
    rate: float | None
    duration_s: float
    requests: int
    ok: int
    statuses: dict[str, int]
    throughput_rps: float
    images_per_s: float
    latency_ms: dict[str, float]
    server_timing_ms: dict[str, float] = field(default_factory=dict)  # mean per stage
    mean_batch_size: float | None = None


def percentiles(latencies_s: list[float]) -> dict[str, float]:
    if not latencies_s:
        return {}
    a = np.asarray(latencies_s) * 1000
    return {
        "p50": round(float(np.percentile(a, 50)), 3),
        "p90": round(float(np.percentile(a, 90)), 3),
        "p99": round(float(np.percentile(a, 99)), 3),
        "mean": round(float(a.mean()), 3),
        "max": round(float(a.max()), 3),
    }


def parse_server_timing(header: str) -> dict[str, float]:
    return {k: float(v) for k, v in re.findall(r"(\w+);dur=([0-9.]+)", header)}


async def _metric(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


class _Recorder:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.statuses: Counter[str] = Counter()
        self.stages: Counter[str] = Counter()
        self.timed = 0

    async def send(self, session: aiohttp.ClientSession, url: str, req: Request, t0: float) -> None:
        headers = {"Content-Type": req.content_type, "Accept": req.accept, **req.headers}
        try:
            async with session.post(url, data=req.body, headers=headers) as r:
                await r.read()
                status = str(r.status)
                timing = r.headers.get("Server-Timing", "")
        except aiohttp.ClientError as e:
            status, timing = type(e).__name__, ""
        self.latencies.append(time.perf_counter() - t0)
        self.statuses[status] += 1
        if status == "200" and timing:
            self.stages.update(parse_server_timing(timing))
            self.timed += 1


async def run_load(
    url: str,
    request: Request,
    *,
    concurrency: int | None = None,
    rate: float | None = None,
    duration_s: float = 10.0,
    images_per_request: int = 1,
    seed: int = 0,
) -> LoadResult:
    """Closed loop with `concurrency` clients, or open loop at `rate` requests/s."""
    if (concurrency is None) == (rate is None):
        raise ValueError("give exactly one of concurrency and rate")
    limit = concurrency or 1000
    connector = aiohttp.TCPConnector(limit=limit, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120)
    rec = _Recorder()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        batches0 = await _metric(session, url, "clipserve_batch_size_count")
        items0 = await _metric(session, url, "clipserve_batch_size_sum")
        start = time.perf_counter()
        end = start + duration_s
        if concurrency is not None:

            async def client() -> None:
                while time.perf_counter() < end:
                    await rec.send(session, url + request.path, request, time.perf_counter())

            await asyncio.gather(*(client() for _ in range(concurrency)))
        else:
            assert rate is not None
            rng = random.Random(seed)
            tasks = []
            scheduled = start
            while scheduled < end:
                delay = scheduled - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(
                    asyncio.create_task(rec.send(session, url + "/embed", request, scheduled))
                )
                scheduled += rng.expovariate(rate)
            await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
        batches = await _metric(session, url, "clipserve_batch_size_count") - batches0
        items = await _metric(session, url, "clipserve_batch_size_sum") - items0
    ok = rec.statuses.get("200", 0)
    return LoadResult(
        mode="closed" if concurrency is not None else "open",
        concurrency=concurrency,
        rate=rate,
        duration_s=round(elapsed, 3),
        requests=len(rec.latencies),
        ok=ok,
        statuses=dict(rec.statuses),
        throughput_rps=round(ok / elapsed, 3),
        images_per_s=round(ok * images_per_request / elapsed, 3),
        latency_ms=percentiles(rec.latencies),
        server_timing_ms={k: round(v / max(rec.timed, 1), 3) for k, v in rec.stages.items()},
        mean_batch_size=round(items / batches, 3) if batches else None,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--image", type=Path, required=True)
    parser.add_argument("--content-type", default="image/jpeg")
    parser.add_argument("--concurrency", type=int)
    parser.add_argument("--rate", type=float)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.concurrency is None and args.rate is None:
        args.concurrency = 1
    result = asyncio.run(
        run_load(args.url, Request(args.image.read_bytes(), args.content_type),
                 concurrency=args.concurrency, rate=args.rate, duration_s=args.duration)
    )  # fmt: skip
    text = json.dumps(asdict(result), indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
