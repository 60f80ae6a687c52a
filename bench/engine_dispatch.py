"""The engine's own cost: batching and dispatch per item, on one core, with a free executor.

Everything runs in this process, pinned to one core (`os.sched_setaffinity`, before any thread
starts, so the device threads share it): clients on the event loop admit a request, `run` it
through a `Batcher` and release its ticket, as the pipeline does, 2048 images in flight, so
what is measured is the engine: admission, queue put and take, the device worker's dispatch
and thread hops, stacking the batch, answering the requests. Two executor paths:

- `gpu`: the pipelined worker (depth 2) over `FreeDevice`, a device that costs nothing: its
  `launch` stacks the batch on the host (the copy every executor makes into its staging) and
  returns rows normalised "on the device", as CUDA executors do;
- `cpu`: the synchronous worker over the fake backend with `compute=0` (stacking, L2
  normalisation and the bisection wrapper on the host: today's CPU path).

Variants, measured side by side in interleaved rounds (order rotated):

- `before-<path>-<n>`: the batching package as of `--before` (extracted with `git show` into a
  temporary package, imports rewritten; nothing of it is installed or importable else);
- `after-<path>-<n>`: the working tree's `clipserve.batching`;
- `floor-<n>`: the same clients over a tower that answers at once: the driver's own cost,
  subtracted to get the engine's.

`n` = 1: single-image requests; 32: 32-image requests whose items are views into one body, as
the msgpack and raw codecs hand them over. Reported: items/s of the whole process (wall clock:
on a shared machine, noisy), and the engine's CPU microseconds per item (process CPU less the
floor's), from which items/s of the engine alone on one core and the 32-image/single ratio.

The take sweep: `_pop` of each queue on its own, the queue kept at L items (16..4096, single-item
requests: most with deadlines in arrival order, one in ten with an earlier one, one in ten
without), microseconds per take of 16 and of 256 items.

    python -m bench.engine_dispatch --out bench/results/engine-dispatch.json
    python -m bench.engine_dispatch --only after-gpu-32 --seconds 10   # one variant: py-spy
    py-spy record --gil --format raw -o after.txt -- python -m bench.engine_dispatch --only ...
    python -m bench.engine_dispatch ... --profile after-gpu-32=after.txt   # its summary
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from bench.common import REPO, machine, rotated, say, spread, utc_now, write_report
from clipserve.backends.fake import FakeExecutor
from clipserve.batching.tower import Completed
from clipserve.config import BatchingConfig
from clipserve.inference.preprocess import PreprocessSpec
from clipserve.metrics import Metrics

BEFORE = "HEAD"  # round 3 against round 2 (the O(1) queue, committed); round 2 ran fe60cf3
EMBED_DIM = 512
IN_FLIGHT = 2048  # items in flight: enough for full batches behind the one computing
CONFIG = BatchingConfig(
    max_batch_size=256, max_queue_size=4096, max_queue_delay_ms=0.0, pipeline_depth=1
)
PATHS = ("gpu", "cpu")
SWEEP = (16, 64, 256, 1024, 4096)


def old_batching(rev: str) -> ModuleType:
    """`clipserve.batching` as of `rev`, as a package of its own under a temporary directory."""
    name = f"_batching_{rev}"
    root = Path(tempfile.mkdtemp(prefix="engine-dispatch-"))
    (root / name).mkdir()
    listing = subprocess.run(
        ["git", "ls-tree", "--name-only", rev, "clipserve/batching/"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    for path in listing.split():
        if not path.endswith(".py"):
            continue
        module = Path(path).stem
        source = subprocess.run(
            ["git", "show", f"{rev}:{path}"],
            cwd=REPO,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        source = re.sub(r"\bclipserve\.batching\b", name, source)
        (root / name / f"{module}.py").write_text(source)
    sys.path.insert(0, str(root))
    return importlib.import_module(name)


def revision(rev: str) -> str:
    """`rev` as a short commit id, so the report names what it measured against."""
    return subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.strip()


def batching(impl: str, before: str) -> ModuleType:
    return (
        importlib.import_module("clipserve.batching") if impl == "after" else old_batching(before)
    )


class _NullTicket:
    def release_all(self) -> None:
        pass


class FloorTower:
    """Answers at once: what the clients cost without an engine behind them."""

    def __init__(self) -> None:
        self.rows = np.zeros((32, EMBED_DIM), dtype=np.float32)

    def admit(self, n: int, deadline: float | None = None) -> _NullTicket:
        return _NullTicket()

    async def run(self, ticket: Any, arrays: Sequence[np.ndarray], **_: Any) -> Completed:
        await asyncio.sleep(0)  # one trip through the loop, as a queued item makes at least
        return Completed(self.rows[: len(arrays)], 0.0, 0.0)

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


class FreeDevice(FakeExecutor):
    """A GPU that costs nothing: `launch` assembles the batch on the host (the copy every real
    executor makes into its staging memory) and returns rows already normalised, as the
    device would; the pipelined worker drives it as it drives CUDA."""

    def __init__(self, spec: PreprocessSpec) -> None:
        super().__init__(spec, EMBED_DIM, "sim:0", compute=False)
        self.asynchronous = True
        rows = np.random.default_rng(0).standard_normal((CONFIG.max_batch_size, EMBED_DIM))
        self.rows = (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)

    def launch(self, arrays: Sequence[np.ndarray], normalize: np.ndarray) -> object:
        np.stack(arrays)
        self.batches.append(len(arrays))
        return self.rows[: len(arrays)]

    def wait(self, launched: object) -> np.ndarray:
        assert isinstance(launched, np.ndarray)
        return launched


@dataclass
class Sample:
    items: int
    wall_s: float
    cpu_s: float
    batches: int


def requests(n: int, size: int, count: int) -> list[list[np.ndarray]]:
    """`count` requests of n images each; a request's images are views into one body."""
    out = []
    for i in range(count):
        body = np.full((n, size, size, 3), i % 251, dtype=np.uint8)
        out.append(list(body))
    return out


async def drive(
    impl: str, path: str, n: int, seconds: float, size: int, modules: dict[str, Any]
) -> Sample:
    """`path`: gpu, the pipelined worker over a free device (depth 2, normalised there); cpu,
    the synchronous worker over the fake with compute=0 (stacking and L2 on the host)."""
    spec = PreprocessSpec((size, size), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    fake = FreeDevice(spec) if path == "gpu" else FakeExecutor(spec, EMBED_DIM, compute=False)
    config = CONFIG if path == "cpu" else replace(CONFIG, pipeline_depth=2)
    tower: Any = (
        FloorTower() if impl == "floor" else modules[impl].Batcher([fake], config, Metrics())
    )
    tower.start()
    bodies = requests(n, size, IN_FLIGHT // n)
    counting = False
    items = 0

    async def client(arrays: list[np.ndarray]) -> None:
        nonlocal items
        while True:
            deadline = time.perf_counter() + 30.0
            ticket = tower.admit(n, deadline)
            try:
                await tower.run(ticket, arrays, normalize=True, request_id="b", deadline=deadline)
            finally:
                ticket.release_all()
            if counting:
                items += n

    tasks = [asyncio.create_task(client(arrays)) for arrays in bodies]
    await asyncio.sleep(min(0.5, seconds / 4))  # warm: the queue full, batches steady
    batches0 = len(fake.batches)
    counting = True
    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.sleep(seconds)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    counting = False
    batches = len(fake.batches) - batches0
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await tower.stop()
    return Sample(items, wall, cpu, batches)


def sweep_queue(module: ModuleType, length: int, take: int, reps: int) -> float:
    """Microseconds per `_pop` of `take` items with `length` queued (refilled untimed)."""
    loop = asyncio.new_event_loop()
    queue = module.BatchQueue()
    admission = module.Admission(1 << 30)
    far = time.perf_counter() + 3600.0
    image = np.zeros((32, 32, 3), dtype=np.uint8)
    count = 0

    def refill(k: int) -> None:
        nonlocal count
        items = []
        for _ in range(k):
            count += 1
            # Most requests with the server's timeout (deadlines in arrival order), one in ten
            # with a shorter one of its own (out of order), one in ten without.
            deadline = None if count % 10 == 0 else far + count * 1e-6
            if count % 10 == 5:
                deadline = far - 1800.0
            ticket = admission.admit(1, deadline)
            items.append(
                module.WorkItem(
                    image, True, "s", loop.create_future(), ticket, time.perf_counter(), deadline
                )
            )
        loop.run_until_complete(queue.put(items))

    def cost(n: int) -> float:
        return 0.001

    refill(length)
    spent = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        batch = queue._pop(take, cost)
        spent += time.perf_counter() - t0
        assert len(batch) == take, (len(batch), take)
        for item in batch:
            item.ticket.release(1)
        refill(take)
    loop.close()
    return spent / reps * 1e6


def summarise_profile(raw: Path, top: int = 12) -> list[str]:
    """py-spy's raw (collapsed) stacks as lines: the functions with the most samples on the
    stack (inclusive) and on top of it (self), in percent of all samples."""
    inclusive: dict[str, int] = {}
    own: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
        n = int(count)
        total += n
        for frame in set(frames):
            inclusive[frame] = inclusive.get(frame, 0) + n
        own[frames[-1]] = own.get(frames[-1], 0) + n

    def ranked(counts: dict[str, int], skip: str) -> list[str]:
        rows = sorted(counts.items(), key=lambda kv: -kv[1])
        rows = [(f, c) for f, c in rows if not re.search(skip, f)][:top]
        return [f"  {100 * c / total:5.1f}%  {f}" for f, c in rows]

    frame_noise = r"runpy|runners\.py|base_events\.py|events\.py|<module>|(main|measure) \(bench"
    return [
        f"py-spy record --format raw, {total} samples; inclusive (on the stack):",
        *ranked(inclusive, frame_noise),
        "self (on top of the stack):",
        *ranked(own, "^$"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0, help="measured per variant")
    parser.add_argument("--size", type=int, default=32, help="image side (224: the copies too)")
    parser.add_argument("--cpu", type=int, default=1, help="the core everything is pinned to")
    parser.add_argument("--before", default=BEFORE, help="git revision of the old batching")
    parser.add_argument("--only", help="one variant (e.g. after-32), no report: for profiling")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument(
        "--profile",
        type=Path,
        action="append",
        default=[],
        help="py-spy raw output to summarise into the report (label=path)",
    )
    parser.add_argument("--summarise", type=Path, help="print a py-spy raw file's summary")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.summarise:
        print("\n".join(summarise_profile(args.summarise)))
        return
    os.sched_setaffinity(0, {args.cpu})  # before any thread: the device thread inherits it
    impls = ("before", "after")
    modules = {impl: batching(impl, args.before) for impl in impls}
    if args.only:
        sample = measure(args.only, args, modules)
        say(
            f"{args.only}: {sample.items / sample.wall_s:,.0f} items/s, "
            f"{sample.cpu_s / sample.items * 1e6:.2f} us CPU per item, "
            f"{sample.items / max(sample.batches, 1):.1f} per batch"
        )
        return
    variants = [f"floor-{n}" for n in (1, 32)] + [
        f"{impl}-{path}-{n}" for impl in impls for path in PATHS for n in (1, 32)
    ]
    samples: dict[str, list[Sample]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for variant in rotated(variants, r):
            sample = measure(variant, args, modules)
            samples[variant].append(sample)
            say(f"round {r + 1} {variant}: {sample.cpu_s / sample.items * 1e6:.2f} us/item")
    report = summarise(samples, args)
    if not args.no_sweep:
        report["take_us"] = sweep(modules, args.rounds)
    report["profiles"] = {
        str(p).split("=", 1)[0]: summarise_profile(Path(str(p).split("=", 1)[1]))
        for p in args.profile
    }
    write_report(report, args.out)


def measure(variant: str, args: argparse.Namespace, modules: dict[str, ModuleType]) -> Sample:
    """`floor-N` or `impl-path-N`."""
    impl, *path, n = variant.split("-")
    run = drive(impl, path[0] if path else "", int(n), args.seconds, args.size, modules)
    return asyncio.run(run)


def per_item_us(samples: list[Sample]) -> list[float]:
    return [s.cpu_s / s.items * 1e6 for s in samples]


def summarise(samples: dict[str, list[Sample]], args: argparse.Namespace) -> dict[str, Any]:
    rounds = args.rounds
    engine: dict[str, list[float]] = {}  # engine CPU us per item, round by round
    for impl in ("before", "after"):
        for path in PATHS:
            for n in (1, 32):
                floor = per_item_us(samples[f"floor-{n}"])
                own = per_item_us(samples[f"{impl}-{path}-{n}"])
                engine[f"{impl}-{path}-{n}"] = [a - b for a, b in zip(own, floor, strict=True)]

    def ratio(a: str, b: str, digits: int) -> dict[str, float]:
        return spread([x / y for x, y in zip(engine[a], engine[b], strict=True)], digits)

    return {
        "benchmark": "engine_dispatch",
        "when": utc_now(),
        "machine": machine(),
        "what": (
            f"Batcher in-process on one core (cpu {args.cpu}); gpu: pipelined worker (depth 2) "
            "over a free device that stacks the batch and returns normalised rows; cpu: "
            "synchronous worker over the fake backend compute=0 (L2 on the host); "
            f"{args.size}x{args.size} uint8 items, max batch {CONFIG.max_batch_size}, "
            f"{IN_FLIGHT} items in flight, {args.seconds} s per variant per round; "
            "before = batching as of " + revision(args.before)
        ),
        "rounds": rounds,
        "items_per_s_whole_process": {
            v: spread([s.items / s.wall_s for s in ss], 0) for v, ss in samples.items()
        },
        "mean_batch_size": {
            v: spread([s.items / max(s.batches, 1) for s in ss], 1)
            for v, ss in samples.items()
            if not v.startswith("floor")
        },
        "cpu_us_per_item": {v: spread(per_item_us(ss), 3) for v, ss in samples.items()},
        "engine_cpu_us_per_item": {v: spread(us, 3) for v, us in engine.items()},
        "engine_items_per_s_one_core": {
            v: spread([1e6 / u for u in us], 0) for v, us in engine.items()
        },
        "engine_32_vs_single_per_item": {
            f"{impl}-{path}": ratio(f"{impl}-{path}-32", f"{impl}-{path}-1", 3)
            for impl in ("before", "after")
            for path in PATHS
        },
        "after_vs_before_engine_speedup": {
            f"{path}-{n}": ratio(f"before-{path}-{n}", f"after-{path}-{n}", 2)
            for path in PATHS
            for n in (1, 32)
        },
    }


def sweep(modules: dict[str, ModuleType], rounds: int) -> dict[str, Any]:
    """`_pop` cost by queue length, both queues, interleaved."""
    cells: dict[str, list[float]] = {}
    plan: list[tuple[str, int, int]] = [
        (impl, length, take)
        for impl in ("before", "after")
        for take in (16, 256)
        for length in SWEEP
        if length >= take
    ]
    for r in range(rounds):
        for impl, length, take in rotated(plan, r):
            # Enough takes to cycle the queue several times (compaction is amortised over them);
            # the old queue's scans are slow: fewer.
            reps = 8 * length // take + 50 if impl == "after" else 20
            us = sweep_queue(modules[impl], length, take, reps)
            cells.setdefault(f"{impl} take {take} of {length}", []).append(us)
        say(f"sweep round {r + 1} done")
    return {key: spread(values, 2) for key, values in cells.items()}


if __name__ == "__main__":
    main()
