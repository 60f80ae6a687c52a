"""The load engine: one load point (a concurrency or a rate) against one URL, in one process.

Closed loop: `concurrency` clients send back to back. Open loop: requests are scheduled at
`rate` per second (Poisson or constant arrivals) whatever the server does, and each latency
counts from the request's *intended* send time, so a server that stalls is charged for every
request it kept waiting (no coordinated omission). Requests intended during `warmup_s` are not
recorded. The window closes on time: requests still in flight then are counted as unfinished,
recorded at their age so far (a lower bound), and cancelled, never waited on. Percentiles are
of OK answers (and unfinished requests); error answers have a histogram of their own.

Built on aiohttp (with uvloop where installed): an httpx client at concurrency 32 measures
itself rather than the server.
"""

from __future__ import annotations

import asyncio
import random
import re
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TextIO, TypeVar

import aiohttp

from clipserve.loadgen.payloads import Request
from clipserve.loadgen.stats import Tally

T = TypeVar("T")
_TIMING = re.compile(r"([\w-]+);dur=([0-9.]+)")
_SAMPLE_CHARS = 300


@dataclass(frozen=True)
class LoadSpec:
    """One load point. Exactly one of `concurrency` and `rate`."""

    concurrency: int | None = None
    rate: float | None = None
    arrivals: str = "poisson"  # open loop: poisson | constant
    duration_s: float = 10.0
    warmup_s: float = 0.0
    requests: int | None = None  # measure exactly this many requests instead of a duration
    timeout_s: float = 60.0
    connections: int = 0  # client connection pool; 0 = the concurrency (closed) or 1000 (open)
    seed: int = 0
    keep_raw: bool = False  # also keep every latency (seconds) in Tally.raw

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give exactly one of --concurrency and --rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("--concurrency must be at least 1")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("--rate must be positive")
        if self.arrivals not in ("poisson", "constant"):
            raise ValueError("--arrivals: poisson or constant")
        if self.requests is None and self.duration_s <= 0:
            raise ValueError("--duration must be positive")
        if self.requests is not None and self.requests < 1:
            raise ValueError("--requests must be at least 1")

    @property
    def mode(self) -> str:
        return "closed" if self.concurrency is not None else "open"

    @property
    def load(self) -> str:
        return f"c={self.concurrency}" if self.concurrency is not None else f"{self.rate:g}/s"

    def share(self, index: int, procs: int) -> LoadSpec:
        """This process's part of the load when `procs` client processes share it."""
        from dataclasses import replace

        requests = None
        if self.requests is not None:
            requests = self.requests // procs + (index < self.requests % procs)
        if self.concurrency is not None:
            c = self.concurrency // procs + (index < self.concurrency % procs)
            return replace(self, concurrency=max(c, 1), requests=requests, seed=self.seed + index)
        assert self.rate is not None
        return replace(self, rate=self.rate / procs, requests=requests, seed=self.seed + index)


def parse_server_timing(header: str) -> dict[str, float]:
    return {k: float(v) for k, v in _TIMING.findall(header)}


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on uvloop where it is installed (about 10% more requests per client core)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


Progress = Callable[[float, str, Tally, int], None]
Hook = Callable[[], Coroutine[Any, Any, None]]


class _Run:
    def __init__(self, url: str, requests: Sequence[Request], spec: LoadSpec) -> None:
        if not requests:
            raise ValueError("no requests to send")
        self.url = url.rstrip("/")
        self.requests = requests
        self.urls = [self.url + r.path for r in requests]  # built once, not per request
        self.spec = spec
        self.tally = Tally(raw=[] if spec.keep_raw else None)
        self.inflight: dict[int, float] = {}  # request id → intended send time
        self.next_id = 0
        self.measure_start = 0.0
        self.measure_end = float("inf")
        self.issued = 0  # measured requests issued
        self.stopping = False

    def _record(self, seconds: float, ok: bool = True) -> None:
        if not ok:
            self.tally.error_latency.record(seconds)
            return
        self.tally.latency.record(seconds)
        if self.tally.raw is not None:
            self.tally.raw.append(seconds)

    def _measured(self, intended: float) -> bool:
        return self.measure_start <= intended < self.measure_end

    def _take(self, intended: float) -> bool:
        """Whether a request intended at this time may be sent at all."""
        if self.stopping or intended >= self.measure_end:
            return False
        if self.spec.requests is not None and self._measured(intended):
            if self.issued >= self.spec.requests:
                return False
            self.issued += 1
        return True

    async def one(self, session: aiohttp.ClientSession, intended: float) -> None:
        req = self.requests[self.next_id % len(self.requests)]
        rid = self.next_id
        self.next_id += 1
        self.inflight[rid] = intended
        measured = self._measured(intended)
        t = self.tally
        if measured and self.spec.rate is not None:
            t.send_lag.record(max(0.0, time.perf_counter() - intended))
        try:
            async with session.request(
                req.method,
                self.urls[rid % len(self.urls)],
                data=req.body or None,
                headers=req.headers,
            ) as r:
                body = await r.read()
                status = str(r.status)
                timing = r.headers.get("Server-Timing", "")
        except Exception as e:  # any failure is a result to report, never the end of the run
            status, timing = type(e).__name__, ""
            body = str(e).encode()
        finally:
            done = time.perf_counter()
            self.inflight.pop(rid, None)
        if status == "200" and self.measure_start <= done <= self.measure_end:
            t.window_ok += 1
            t.window_items += req.items
        if not measured or done > self.measure_end:
            if measured:  # finished after the window closed: counted as unfinished there
                t.unfinished += 1
                t.unfinished_max_s = max(t.unfinished_max_s, self.measure_end - intended)
                self._record(self.measure_end - intended)
            return
        self._record(done - intended, ok=status == "200")
        t.completed_s += done - intended
        t.statuses[status] += 1
        t.bytes_sent += len(req.body)
        t.bytes_received += len(body)
        if status == "200":
            t.items_ok += req.items
            if timing:
                t.stage_ms.update(parse_server_timing(timing))
                t.timed += 1
        elif status not in t.error_samples:
            t.error_samples[status] = body[:_SAMPLE_CHARS].decode("utf-8", "replace")

    async def closed_client(self, session: aiohttp.ClientSession) -> None:
        while True:
            intended = time.perf_counter()
            if not self._take(intended):
                return
            await self.one(session, intended)

    async def open_schedule(
        self, session: aiohttp.ClientSession, start: float, tasks: set[asyncio.Task[None]]
    ) -> None:
        assert self.spec.rate is not None
        rng = random.Random(self.spec.seed)
        rate, poisson = self.spec.rate, self.spec.arrivals == "poisson"
        intended = start
        while self._take(intended):
            delay = intended - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            # Late (the loop was busy)? Send now: the latency still counts from `intended`.
            task = asyncio.create_task(self.one(session, intended))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            intended += rng.expovariate(rate) if poisson else 1 / rate

    async def loop_lag(self) -> None:
        """How late the client's own event loop wakes: high means the client is the limit."""
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(0.01)
            late = time.perf_counter() - t0 - 0.01
            if self.measure_start <= t0 < self.measure_end:
                self.tally.loop_lag.record(max(late, 1e-6))

    async def progress(self, report: Progress, start: float) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.perf_counter()
            phase = "warmup" if now < self.measure_start else "measure"
            report(now - start, phase, self.tally, len(self.inflight))

    def close_window(self, end: float) -> None:
        """Account the requests still in flight at `end`; their tasks are cancelled next."""
        self.stopping = True
        for intended in self.inflight.values():
            if self._measured(intended):
                self.tally.unfinished += 1
                self.tally.unfinished_max_s = max(self.tally.unfinished_max_s, end - intended)
                self._record(end - intended)
        self.inflight.clear()

    async def run(
        self, start_at: float | None, progress: Progress | None, on_measure: Hook | None
    ) -> Tally:
        spec = self.spec
        limit = spec.connections or (spec.concurrency or 1000)
        connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit)
        timeout = aiohttp.ClientTimeout(total=spec.timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            if start_at is not None:  # several client processes start together
                await asyncio.sleep(max(0.0, start_at - time.time()))
            if on_measure is not None and not spec.warmup_s:
                await on_measure()  # before the first request
            start = time.perf_counter()
            self.measure_start = start + spec.warmup_s
            if spec.requests is None:
                self.measure_end = self.measure_start + spec.duration_s
            helpers = [asyncio.create_task(self.loop_lag())]
            if progress is not None:
                helpers.append(asyncio.create_task(self.progress(progress, start)))
            tasks: set[asyncio.Task[None]] = set()
            if spec.concurrency is not None:
                for _ in range(spec.concurrency):
                    tasks.add(asyncio.create_task(self.closed_client(session)))
            else:
                tasks.add(asyncio.create_task(self.open_schedule(session, start, tasks)))
            cpu0, measured_from = time.process_time(), self.measure_start
            if spec.warmup_s:
                await asyncio.sleep(spec.warmup_s)
                cpu0 = time.process_time()
                if on_measure is not None:
                    await on_measure()  # the load goes on meanwhile: the window has begun
            if spec.requests is None:
                await asyncio.sleep(max(0.0, self.measure_end - time.perf_counter()))
                end = time.perf_counter()
                self.close_window(end)
            else:
                # The open-loop scheduler adds tasks while it runs: wait until none is left.
                while pending := [t for t in tasks if not t.done()]:
                    await asyncio.gather(*pending, return_exceptions=True)
                end = time.perf_counter()
                self.stopping = True
            cpu = time.process_time() - cpu0
            for task in [*tasks, *helpers]:
                task.cancel()
            await asyncio.gather(*tasks, *helpers, return_exceptions=True)
        if progress is not None:
            progress(time.perf_counter() - start, "done", self.tally, 0)
        window = max(end - measured_from, 1e-9)
        self.tally.window_s = window
        self.tally.cpu_s = cpu
        self.tally.cpu_fractions = [cpu / window]
        return self.tally


async def run_load(
    url: str,
    requests: Sequence[Request],
    spec: LoadSpec,
    *,
    start_at: float | None = None,
    progress: Progress | None = None,
    on_measure: Hook | None = None,
) -> Tally:
    """Drive one load point from this process; `start_at` is a `time.time()` to begin at;
    `on_measure` is awaited as the measured window opens (after the warm-up)."""
    return await _Run(url, requests, spec).run(start_at, progress, on_measure)


def progress_printer(label: str, spec: LoadSpec, stream: TextIO | None = None) -> Progress:
    """A live line on stderr: in place on a terminal, one line every 5 s otherwise."""
    out = stream or sys.stderr  # looked up now: tests and callers may have replaced stderr
    tty = out.isatty()
    last = [0, 0.0, 0]  # completed and time at the previous line, calls

    def report(elapsed: float, phase: str, tally: Tally, inflight: int) -> None:
        last[2] += 1
        if not tty and last[2] % 5 and phase != "done":
            return
        done = tally.completed
        rate = (done - last[0]) / max(elapsed - last[1], 1e-9)
        last[0], last[1] = done, elapsed
        errors = done - tally.ok
        total = f"/{spec.warmup_s + spec.duration_s:g}s" if spec.requests is None else "s"
        line = (
            f"[{label} {elapsed:5.1f}{total} {phase}] {done} done {rate:7.1f} req/s "
            f"errors {errors} in flight {inflight} p99 {tally.latency.percentile_ms(99):.1f} ms"
        )
        out.write(("\r" + line + "\x1b[K") if tty else line + "\n")
        out.flush()

    return report
