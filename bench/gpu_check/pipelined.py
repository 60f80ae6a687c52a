"""The pipelined sections: each torch variant timed through `launch`/`wait` with K batches in
flight (K = 1, 2, 3: what the pipelined worker keeps with --pipeline-depth K) against `run()`
one batch at a time, and the pipelined worker itself, in-process, at the same depths. Images/s
and per-batch latency are medians over interleaved rounds; launch/wait's rows are checked
against run()'s (cosine >= 0.9999) with K distinct batches in flight.

On the CPU the executor is not asynchronous (its worker runs one batch at a time: the worker
rows say so in `effective_depth`), but launch/wait run anyway, through the device layer's CPU
implementation, so this section checks itself without a GPU."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from bench.common import rotated, spread
from bench.executors import executor_flags
from bench.gpu_check.plan import Emit, Plan
from clipserve.backends.base import AsyncExecutor, Executor, as_async
from clipserve.backends.device import select_device

DEPTHS = (1, 2, 3)
MIN_COSINE = 0.9999  # the FP32 self-check's floor: both paths run the same kernels
MIN_BATCHES = 6  # per timed window, whatever its length
ROUNDS = 3


def pipelined_variants(plan: Plan) -> list[str]:
    return ["torch+fp16", "torch+fp32", "cuda-graphs+fp16"] if plan.cuda else ["torch"]


def batch_sizes(plan: Plan) -> list[int]:
    """A small batch, where the host's share per batch is what pipelining hides, up to a large
    one, where the device is busy anyway."""
    return [4, 16] if plan.quick else [16, 64, 256]


@dataclass
class Timing:
    """One timed window: its wall time, the images done in it, each batch's latency."""

    seconds: float
    images: int
    latencies: list[float]

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds


def time_run(executor: Executor, batch: list[np.ndarray], window_s: float) -> Timing:
    """On the device thread: `run` one batch after another."""
    x = np.stack(batch)
    latencies: list[float] = []
    start = time.perf_counter()
    while len(latencies) < MIN_BATCHES or time.perf_counter() - start < window_s:
        t = time.perf_counter()
        executor.run(x)
        latencies.append(time.perf_counter() - t)
    return Timing(time.perf_counter() - start, len(batch) * len(latencies), latencies)


def time_launch_wait(
    executor: AsyncExecutor,
    batch: list[np.ndarray],
    depth: int,
    window_s: float,
    waiter: ThreadPoolExecutor,
) -> Timing:
    """On the device thread: launch `batch` again and again, at most `depth` in flight, while
    the waiter thread waits for each in launch order, as the worker's feeder and finisher do.
    A batch's latency runs from its launch to its rows being back."""
    mask = np.ones(len(batch), dtype=bool)
    slots = threading.Semaphore(depth)

    def finish(handle: object, launched_at: float) -> float:
        try:
            executor.wait(handle)
            return time.perf_counter() - launched_at
        finally:
            slots.release()

    pending: list[concurrent.futures.Future[float]] = []
    start = time.perf_counter()
    try:
        while len(pending) < MIN_BATCHES or time.perf_counter() - start < window_s:
            slots.acquire()
            t = time.perf_counter()
            try:
                handle = executor.launch(batch, mask)
            except BaseException:
                slots.release()
                raise
            pending.append(waiter.submit(finish, handle, t))
    finally:  # every launched batch waited for, even after a failed launch: slots come back
        concurrent.futures.wait(pending)
    seconds = time.perf_counter() - start
    return Timing(seconds, len(batch) * len(pending), [f.result() for f in pending])


def time_worker(
    executor: Executor,
    thread: ThreadPoolExecutor,
    batch: list[np.ndarray],
    depth: int,
    window_s: float,
) -> tuple[Timing, int, np.ndarray]:
    """The pipelined worker on its own queue, fed whole batches by depth + 1 closed-loop
    clients so one is always waiting: its timing (latency: taken to answered), the depth it
    really kept (1 for a synchronous executor) and the last batch's rows."""
    from clipserve.batching.queue import Admission, BatchQueue, WorkItem
    from clipserve.batching.worker import DeviceWorker
    from clipserve.metrics import Metrics

    n = len(batch)
    rows = np.empty((n, executor.info.embed_dim), np.float32)

    async def main() -> tuple[Timing, int]:
        loop = asyncio.get_running_loop()
        queue = BatchQueue()
        admission = Admission(n * (depth + 2))
        worker = DeviceWorker(
            executor,
            queue,
            max_batch_size=n,
            max_delay_s=0.0,
            metrics=Metrics(),
            thread=thread,
            pipeline_depth=depth,
        )
        latencies: list[float] = []

        async def client(stop: float) -> None:
            while time.perf_counter() < stop or len(latencies) < MIN_BATCHES:
                ticket = admission.admit(n)
                now = time.perf_counter()
                items = [
                    WorkItem(a, True, f"b{i}", loop.create_future(), ticket, now)
                    for i, a in enumerate(batch)
                ]
                await queue.put(items)
                rows[:] = np.stack(await asyncio.gather(*(item.future for item in items)))
                latencies.append(items[0].finished_at - items[0].started_at)

        worker.start()
        try:
            start = time.perf_counter()
            await asyncio.gather(*(client(start + window_s) for _ in range(depth + 1)))
            seconds = time.perf_counter() - start
        finally:
            await worker.stop()
        return Timing(seconds, n * len(latencies), latencies), worker.depth

    timing, kept = asyncio.run(main())
    return timing, kept, rows


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The worst cosine of a's rows with b's; a row that is not finite counts as -1, the worst
    there is (NaN would slip past `min` and any floor)."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        cosines = np.sum(a64 * b64, axis=1) / np.maximum(
            np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1), 1e-300
        )
    return float(np.min(np.where(np.isfinite(cosines), cosines, -1.0)))


def check_launch_wait(
    executor: AsyncExecutor,
    thread: ThreadPoolExecutor,
    waiter: ThreadPoolExecutor,
    batches: Sequence[list[np.ndarray]],
) -> float:
    """All of `batches` launched before any is waited for, each batch's rows then compared
    with run()'s of the same batch: the worst cosine. Distinct batches, so rows handed to the
    wrong batch (a staging slot reused too early) show too."""
    masks = [np.ones(len(b), dtype=bool) for b in batches]

    def launch_all() -> list[object]:
        return [executor.launch(b, m) for b, m in zip(batches, masks, strict=True)]

    handles = thread.submit(launch_all).result()
    got = [waiter.submit(executor.wait, h).result() for h in handles]
    worst = 1.0
    for b, rows in zip(batches, got, strict=True):
        worst = min(worst, min_cosine(rows, thread.submit(executor.run, np.stack(b)).result()))
    return worst


Mode = tuple[str, int]  # ("run", 1) | ("launch_wait", K) | ("worker", K)
# One timed window of a mode: its timing, the depth kept, the rows of its last batch (workers').
Timer = Callable[[], tuple[Timing, int, np.ndarray]]


def _modes() -> list[Mode]:
    return [("run", 1)] + [(m, k) for m in ("launch_wait", "worker") for k in DEPTHS]


def _rows_for(
    size: int, samples: dict[Mode, list[Timing]], kept: dict[int, int]
) -> list[dict[str, Any]]:
    runs = samples[("run", 1)]
    out = []
    for (mode, depth), timings in samples.items():
        # Each round's rate over the same round's run(): drift on a shared host cancels.
        ratios = [t.images_per_s / r.images_per_s for t, r in zip(timings, runs, strict=True)]
        row: dict[str, Any] = {
            "batch": size,
            "mode": mode,
            "depth": depth,
            "images_per_s": spread([t.images_per_s for t in timings], 1),
            "latency_ms": spread([np.median(t.latencies) * 1000 for t in timings], 3),
            "vs_run": spread(ratios, 3),
            "batches": sum(len(t.latencies) for t in timings),
        }
        if mode == "worker":
            row["effective_depth"] = kept[depth]
        out.append(row)
    return out


def section_pipelined(plan: Plan, emit: Emit, variant: str) -> dict[str, Any]:
    from clipserve.config import load_config
    from clipserve.inference.runtime import build_runtime

    sizes = batch_sizes(plan)
    model = {"model": plan.model, "pretrained": "none", "gpus": plan.gpus}
    # No self-check: this section compares the executor with itself, not with a reference.
    flags = {**executor_flags(model, variant, sizes), "self_check": "off"}
    t0 = time.perf_counter()
    runtime = build_runtime(load_config(flags, environ={}))
    startup_s = time.perf_counter() - t0
    executor, thread = runtime.executors[0], runtime.threads[0]
    info = executor.info
    waiter = ThreadPoolExecutor(
        1, thread_name_prefix="gpu-check-wait", initializer=select_device, initargs=(info.device,)
    )
    window_s = 0.1 if plan.quick else 0.5
    result: dict[str, Any] = {
        "backend": info.backend,
        "device": info.device,
        "precision": info.precision,
        "asynchronous": bool(getattr(executor, "asynchronous", False)),
        "startup_s": round(startup_s, 1),
        "window_s": window_s,
        "rounds": ROUNDS,
        "depths": list(DEPTHS),
        "check": {"floor": MIN_COSINE, "min_cosine": {}, "worker_min_cosine": {}},
        "rows": [],
    }
    check = result["check"]
    lw = launchable(executor)
    h, w = info.input_size
    rng = np.random.default_rng(0)
    try:
        for size in sizes:
            distinct = [list(rng.integers(0, 256, (size, h, w, 3), dtype=np.uint8)) for _ in DEPTHS]
            check["min_cosine"][str(size)] = round(
                check_launch_wait(lw, thread, waiter, distinct), 7
            )
            timers = _timers(executor, lw, thread, waiter, distinct[0], window_s)
            reference = thread.submit(executor.run, np.stack(distinct[0])).result()
            rows, worst_worker = _measure(size, timers, reference)
            check["worker_min_cosine"][str(size)] = round(worst_worker, 7)
            result["rows"] += rows
            emit(result)
    finally:
        waiter.shutdown(wait=True)
        runtime.close()
    worst = min([*check["min_cosine"].values(), *check["worker_min_cosine"].values()])
    check["passed"] = worst >= MIN_COSINE
    if not check["passed"]:
        emit(result)
        raise RuntimeError(f"launch/wait or the worker differ from run(): cosine {worst}")
    return result


def _measure(
    size: int, timers: dict[Mode, Timer], reference: np.ndarray
) -> tuple[list[dict[str, Any]], float]:
    """Every mode once untimed (the slot ring grows to K), then ROUNDS interleaved rounds: the
    rows, and the worst cosine of the worker's rows against `reference` (run()'s)."""
    for timer in timers.values():
        timer()
    samples: dict[Mode, list[Timing]] = {m: [] for m in _modes()}
    kept: dict[int, int] = {}
    worst = 1.0
    for r in range(ROUNDS):
        for mode in rotated(_modes(), r):
            timing, depth_kept, rows = timers[mode]()
            samples[mode].append(timing)
            if mode[0] == "worker":
                kept[mode[1]] = depth_kept
                worst = min(worst, min_cosine(rows, reference))
    return _rows_for(size, samples, kept), worst


def _timers(
    executor: Executor,
    lw: AsyncExecutor,
    thread: ThreadPoolExecutor,
    waiter: ThreadPoolExecutor,
    batch: list[np.ndarray],
    window_s: float,
) -> dict[Mode, Timer]:
    """One timed window of each mode; run() and the launches on the executor's own thread."""
    none = np.empty((0, 0), np.float32)

    def run() -> tuple[Timing, int, np.ndarray]:
        return thread.submit(time_run, executor, batch, window_s).result(), 1, none

    def launch_wait(k: int) -> Timer:
        def timer() -> tuple[Timing, int, np.ndarray]:
            timing = thread.submit(time_launch_wait, lw, batch, k, window_s, waiter).result()
            return timing, k, none

        return timer

    def worker(k: int) -> Timer:
        return lambda: time_worker(executor, thread, batch, k, window_s)

    timers: dict[Mode, Timer] = {("run", 1): run}
    for k in DEPTHS:
        timers[("launch_wait", k)] = launch_wait(k)
        timers[("worker", k)] = worker(k)
    return timers


def launchable(executor: Executor) -> AsyncExecutor:
    """The executor's launch/wait, even where `asynchronous` is false (the CPU): there the
    device layer runs the same lines eagerly."""
    if not hasattr(executor, "launch") or not hasattr(executor, "wait"):
        raise TypeError(f"{executor.info.backend} has no launch/wait")
    return as_async(executor) or cast(AsyncExecutor, executor)
