"""Where a server's time goes at saturation: a py-spy profile of the whole tree, summarised per
process and thread."""

from __future__ import annotations

import re
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.frontend.servers import Running, Server, affinity, start

# Start-up stacks (imports, building the model): only serving is summarised. Images only: the
# tokenizer shows up only in start-up.
STARTUP = (
    "_find_and_load",
    "build_runtime",
    "load_model",
    "create_model",
    "warmup",
    "tokenizer.py",
)

# Leaf frames where a thread waits, or runs uvloop's C loop (epoll, socket I/O, httptools):
# py-spy's idle filter does not catch every sleeping thread here (a 0.5 s sleep loop shows).
WAITING = (
    "Runner.run (asyncio/runners.py)",
    "Selector.select (selectors.py)",
    "_worker (concurrent/futures/thread.py)",
    "watch (clipserve/engine/supervisor.py)",
    "main (multiprocessing/resource_tracker.py)",
    "Condition.wait (threading.py)",
)

# Frames every serving stack passes through: no information in their inclusive share.
OUTER = (
    "(<frozen runpy>)",
    "(clipserve/__main__.py)",
    "(clipserve/cli.py)",
    "(asyncio/runners.py)",
    "(uvicorn/_compat.py)",
    "(uvicorn/server.py)",
    "(threading.py)",
    "(asyncio/base_events.py)",
    "(multiprocessing/",
)

# The packages a leaf frame's own time is charged to.
AREAS = (
    "uvicorn",
    "starlette",
    "clipserve",
    "prometheus_client",
    "asyncio",
    "anyio",
    "numpy",
    "PIL",
    "multiprocessing",
    "concurrent",
    "threading",
    "selectors",
)

KINDS = ("self", "inclusive", "area", "thread", "loop_self", "loop_lines")


def profile(
    s: Server,
    cpus: tuple[set[int] | None, set[int] | None],
    point: Callable[[Running], dict[str, Any]],
    out: Path,
) -> dict[str, Any]:
    """A saturation `point` on `s` started under py-spy (the server on `cpus[0]`, this process
    on `cpus[1]`): its rate, and the profile's summary."""
    server_cpus, client_cpus = cpus
    with start(s, server_cpus, profile=out) as r, affinity(client_cpus):
        row = point(r)
    deadline = time.monotonic() + 30
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    summary = summarise_profile(out) if out.exists() else {}
    return {
        "under_py_spy": {k: row[k] for k in ("requests_per_s", "server_cores_busy")},
        "processes": summary,
    }


def summarise_profile(path: Path, top: int = 12) -> dict[str, Any]:
    """py-spy's raw (collapsed) stacks, per process: the share of samples per thread (the event
    loop is MainThread), the leaf functions (self) and the functions on the stack (inclusive)
    with the largest shares, and the event loop thread's own leaf functions and lines. Start-up
    stacks (imports, building the model) are dropped: only serving is summarised."""
    procs: dict[str, dict[str, Counter[str]]] = defaultdict(lambda: {k: Counter() for k in KINDS})
    totals: Counter[str] = Counter()
    frontend: set[str] = set()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        heads = list(re.finditer(r'process (\d+):"(.*?)";', stack))
        if not heads or not count.isdigit() or any(s in stack for s in STARTUP):
            continue
        pid = heads[-1].group(1)
        frames = [f for f in stack[heads[-1].end() :].split(";") if f]
        thread = "?"
        if frames and frames[0].startswith("thread ("):
            # "thread (123): ThreadPoolExecutor-0_3" → "ThreadPoolExecutor-N_N"
            thread = re.sub(r"\d+", "N", frames.pop(0).partition(": ")[2] or "unnamed")
        if not frames:
            continue
        n = int(count)
        totals[pid] += n
        _count(procs[pid], frames, thread, n)
        if any("uvicorn" in f for f in frames):
            frontend.add(pid)
    return {
        pid: _summary(procs[pid], total, pid in frontend, top)
        for pid, total in totals.most_common()
    }


def _count(c: dict[str, Counter[str]], frames: list[str], thread: str, n: int) -> None:
    """One stack seen `n` times, into a process's counters."""
    names = [re.sub(r":\d+\)$", ")", f) for f in frames]  # per function, not per line
    c["self"][names[-1]] += n
    for name in set(names):
        c["inclusive"][name] += n
    c["area"][_area(frames[-1])] += n
    c["thread"][thread] += n
    if thread == "MainThread" and not _waiting(names[-1]):
        c["loop_self"][names[-1]] += n
        c["loop_lines"][frames[-1]] += n


def _summary(c: dict[str, Counter[str]], total: int, frontend: bool, top: int) -> dict[str, Any]:
    def share(counter: Counter[str], k: int = top) -> list[tuple[str, float]]:
        return [(name, round(v / total, 3)) for name, v in counter.most_common(k)]

    waiting = sum(v for k, v in c["self"].items() if _waiting(k))
    return {
        "role": "front end (uvicorn)" if frontend else "engine / supervisor",
        "samples": total,
        "shares_are_of": "all samples of this process",
        "by_thread": share(c["thread"], 8),
        "self": share(c["self"]),
        "inclusive": [x for x in share(c["inclusive"], 4 * top) if not _outer(x[0])][:top],
        "self_by_package": share(c["area"], 10),
        "waiting_or_in_c_loop": round(waiting / total, 3),
        # of the event loop thread's samples not in WAITING frames:
        "event_loop_thread_busy_self": _shares(c["loop_self"], 2 * top),
        "event_loop_thread_busy_lines": _shares(c["loop_lines"], top),
    }


def _shares(counter: Counter[str], k: int) -> list[tuple[str, float]]:
    total = sum(counter.values()) or 1
    return [(name, round(v / total, 3)) for name, v in counter.most_common(k)]


def _waiting(name: str) -> bool:
    return any(w in name for w in WAITING)


def _outer(name: str) -> bool:
    return any(o in name for o in OUTER)


def _area(frame: str) -> str:
    m = re.search(r"\((.*?):\d+\)$", frame)
    file = m.group(1) if m else frame
    for key in AREAS:
        if f"/{key}/" in file or file.startswith(f"{key}/") or f"{key}.py" in file:
            return key
    return "other: " + file.rsplit("/", 1)[-1]
