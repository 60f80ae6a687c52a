"""A load point from start to result: drive (in one or several client processes), scrape the
server as the measured window opens (after the warm-up) and after it, merge, and judge whether
the client itself was the limit."""

from __future__ import annotations

import multiprocessing
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from clipserve.loadgen.loadgen import Hook, LoadSpec, progress_printer, run_async, run_load
from clipserve.loadgen.payloads import Request
from clipserve.loadgen.server import Breakdown, Samples, breakdown, scrape
from clipserve.loadgen.stats import Tally

# Past these the client, not the server, may be what was measured.
CPU_SATURATED = 0.85  # of one core, per client process
SEND_LAG_MS = 5.0  # open loop, p99 of (actual - intended) send time
LOOP_LAG_MS = 20.0  # p99 lateness of the client's own 10 ms timer


@dataclass
class PointResult:
    mode: str
    load: str
    concurrency: int | None
    rate: float | None
    procs: int
    window_s: float
    completed: int
    ok: int
    unfinished: int
    statuses: dict[str, int]
    error_samples: dict[str, str]
    requests_per_s: float
    images_per_s: float
    latency_ms: dict[str, float]  # OK answers (and unfinished requests, at their age)
    send_lag_ms: dict[str, float]
    client_loop_lag_ms: dict[str, float]
    client_cpu: list[float]
    server_timing_ms: dict[str, float]
    server: dict[str, Any] | None
    warnings: list[str] = field(default_factory=list)
    usd_per_million_images: float | None = None
    latency_hist: str = ""  # HdrHistogram, encoded: merge or re-read percentiles later
    error_latency_ms: dict[str, float] = field(default_factory=dict)  # error answers apart

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _child(
    url: str, requests: Sequence[Request], spec: LoadSpec, start_at: float
) -> dict[str, Any]:
    return run_async(run_load(url, requests, spec, start_at=start_at)).to_dict()


def drive(
    url: str,
    requests: Sequence[Request],
    spec: LoadSpec,
    procs: int = 1,
    progress: bool = False,
    label: str = "",
    on_measure: Hook | None = None,
) -> Tally:
    """The merged tally of `procs` client processes sharing the load; `on_measure` runs as
    the measured window opens."""
    if procs <= 1:
        printer = progress_printer(label or spec.load, spec) if progress else None
        tally = run_async(run_load(url, requests, spec, progress=printer, on_measure=on_measure))
        if progress and sys.stderr.isatty():
            sys.stderr.write("\n")
        return tally
    ctx = multiprocessing.get_context("spawn")
    start_at = time.time() + 2.0 + 0.3 * procs  # room for the children to start
    with ProcessPoolExecutor(procs, mp_context=ctx) as pool:
        futures = [
            pool.submit(_child, url, requests, spec.share(i, procs), start_at) for i in range(procs)
        ]
        if on_measure is not None:  # at start_at + warm-up (now, without one): children run on
            if spec.warmup_s:
                time.sleep(max(0.0, start_at + spec.warmup_s - time.time()))
            run_async(on_measure())
        tallies = [Tally.from_dict(f.result()) for f in futures]
    merged = tallies[0]
    for t in tallies[1:]:
        merged.merge(t)
    return merged


async def _scrape_once(url: str) -> Samples | None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        return await scrape(session, url)


def judge(tally: Tally, spec: LoadSpec) -> list[str]:
    warnings = []
    worst = max(tally.cpu_fractions, default=0.0)
    if worst >= CPU_SATURATED and tally.window_s >= 1.0:
        warnings.append(
            f"client CPU at {worst:.0%} of a core: the load generator may be the bottleneck "
            "(add --procs, or run it on another machine)"
        )
    loop_lag = tally.loop_lag.percentile_ms(99)
    if loop_lag > LOOP_LAG_MS and tally.window_s >= 1.0:
        warnings.append(
            f"the client's event loop ran {loop_lag:.0f} ms late (p99): it is short of CPU "
            "(busy itself, or crowded out by other processes); add --procs or free a core"
        )
    if spec.rate is not None and tally.send_lag.count:
        lag = tally.send_lag.percentile_ms(99)
        if lag > SEND_LAG_MS:
            warnings.append(
                f"sends fell behind schedule (p99 lag {lag:.1f} ms): the client could not keep "
                f"{spec.rate:g} req/s; latencies still count from the intended times"
            )
    errors = tally.completed - tally.ok
    if errors:
        worst_status = max(
            (s for s in tally.statuses if s != "200"), key=lambda s: tally.statuses[s]
        )
        warnings.append(f"{errors} of {tally.completed} requests failed (most: {worst_status})")
    oldest = tally.unfinished_max_s * 1000
    mean_ms = tally.completed_s / tally.completed * 1000 if tally.completed else 0.0
    if tally.unfinished and oldest > max(1000.0, 3 * mean_ms):
        warnings.append(
            f"{tally.unfinished} requests were still in flight when the window closed, the "
            f"oldest for {oldest:,.0f} ms (counted at their age then: a stall?)"
        )
    return warnings


def run_point(
    url: str,
    requests: Sequence[Request],
    spec: LoadSpec,
    *,
    procs: int = 1,
    progress: bool = False,
    usd_per_hour: float | None = None,
) -> PointResult:
    scraped: list[Samples | None] = []

    async def scrape_before() -> None:
        # When the window opens, not before the warm-up: the server's counts match the client's.
        scraped.append(await _scrape_once(url))

    # Also one before any load: the window's scrape runs under it, and may time out or meet
    # a full server; then the counts start before the warm-up (and the point says so).
    early = run_async(_scrape_once(url))
    tally = drive(url, requests, spec, procs, progress, on_measure=scrape_before)
    before = scraped[0] if scraped else None
    notes = []
    if before is None and early is not None:
        before = early
        notes.append(
            "the server's metrics at the window's start were unreadable under load: "
            "its numbers include the warm-up"
        )
    after = run_async(_scrape_once(url))
    server: Breakdown | None = breakdown(before, after)
    window = tally.window_s
    rps = tally.window_ok / window
    ips = tally.window_items / window
    timing = (
        {k: round(v / tally.timed, 3) for k, v in tally.stage_ms.items()} if tally.timed else {}
    )
    cost = round(usd_per_hour / (ips * 3600) * 1e6, 4) if usd_per_hour and ips > 0 else None
    return PointResult(
        mode=spec.mode,
        load=spec.load,
        concurrency=spec.concurrency,
        rate=spec.rate,
        procs=procs,
        window_s=round(window, 3),
        completed=tally.completed,
        ok=tally.ok,
        unfinished=tally.unfinished,
        statuses=dict(tally.statuses),
        error_samples=tally.error_samples,
        requests_per_s=round(rps, 3),
        images_per_s=round(ips, 3),
        latency_ms=tally.latency.summary(),
        send_lag_ms=tally.send_lag.summary(),
        client_loop_lag_ms=tally.loop_lag.summary(),
        client_cpu=[round(c, 3) for c in tally.cpu_fractions],
        server_timing_ms=timing,
        server=server.to_dict() if server else None,
        warnings=judge(tally, spec) + notes,
        usd_per_million_images=cost,
        latency_hist=tally.latency.encode(),
        error_latency_ms=tally.error_latency.summary(),
    )
