"""Front ends (`--workers N`, issue 8): what the HTTP side costs, whether batching and throughput
hold up across front-end processes, and whether CPU serving regressed. One JSON, five sections,
each in interleaved rounds (this machine is shared and noisy) with medians and spread:

  cost        CPU-seconds of every server process (psutil over the tree) per request at
              saturation, for single-image raw uint8 tensors (224x224x3) and 640x480 JPEGs, beside
              a bare-Starlette floor (bench/frontend_floor.py) in the same rounds; fake backend
              with compute=0, so the fake's own work is O(1) per image. JPEG decode is measured
              offline (per round, on the server's cores) and reported as its own share. Server
              pinned to the first cores, the load generator (wrk, else clipserve-bench's aiohttp
              client) to the last; /readyz answers once one front end is up, so load waits until
              all N listen. --cost-before-tree adds a one-process checkout (its fake must know
              compute=0). A py-spy profile (py-spy starts the server: here it may trace only its
              own descendants) says where each variant's time goes, per process and thread.
              Points with over 1% failed requests stay in the rows, out of the summaries.
  batching    mean batch size (/metrics clipserve_batch_size) at a fixed open-loop rate with a
              20 ms fake batch, N front ends against one: target within 10%.
  scaling     saturated requests/s of tensor requests with each of --workers-list front ends.
  regression  served images/s at concurrency 32, tiny real model on CPU, JPEGs, --workers 1,
              against --before-tree (a checkout of the commit before issue 8), and the server
              tree's CPU per image (steadier than img/s on a shared machine). Runs with policy.
  policy      the same load: batch-size histogram, img/s and p99 for the before tree and for
              --max-queue-delay-ms in --delays.

    python -m bench.frontend --quick                        # every section, one short round
    git worktree add --detach /tmp/clipserve-before 70dba1d
    python -m bench.frontend --before-tree /tmp/clipserve-before
    python -m bench.frontend --sections scaling --workers-list 1,2,4,8,14 --client-cores 2
                                                            # a 16-core host, no GPU needed
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil  # type: ignore[import-untyped]

from bench.common import machine, utc_now
from clipserve.inference.preprocess import ImageDecoder
from clipserve.loadgen.images import load_images
from clipserve.loadgen.loadgen import LoadSpec
from clipserve.loadgen.payloads import ModelInput, Request, build_requests
from clipserve.loadgen.procs import TINY_CONFIG, free_port, machine_slug, pin, wait_ready
from clipserve.loadgen.runner import run_point
from clipserve.loadgen.server import Samples, breakdown, parse_metrics

SECTIONS = ("cost", "batching", "scaling", "regression", "policy")
ROOT = Path(__file__).resolve().parent.parent
# The fake answers a 512-float embedding, as ViT-B-32 does and the floor does.
FAKE_CONFIG = {**TINY_CONFIG, "embed_dim": 512}


# ---------------------------------------------------------------------------------- servers


@dataclass
class Server:
    name: str
    argv: list[str]  # after `python`, without --host/--port
    cwd: Path = ROOT
    env: dict[str, str] | None = None
    clipserve: bool = True
    front_ends: int = 1


@dataclass
class Running:
    server: Server
    proc: subprocess.Popen[bytes]  # py-spy when profiled, else the server itself
    root: psutil.Process  # the server's first process
    url: str


def clipserve(name: str, flags: Sequence[str], tree: Path | None = None) -> Server:
    env = {**os.environ, "PYTHONPATH": str(tree)} if tree else None
    n = int(flags[flags.index("--workers") + 1]) if "--workers" in flags else 1
    argv = ["-m", "clipserve", *flags, "--log-level", "warning"]
    return Server(name, argv, tree or ROOT, env, front_ends=n)


def floor() -> Server:
    argv = [
        "-m",
        "uvicorn",
        "bench.frontend_floor:app",
        "--http",
        "httptools",
        "--log-level",
        "warning",
        "--no-access-log",
    ]
    return Server("floor", argv, clipserve=False)


@contextlib.contextmanager
def start(
    s: Server, cpus: set[int] | None, profile: Path | None = None, startup_s: float = 300
) -> Iterator[Running]:
    """The server on a free port, pinned to `cpus`; under `py-spy record` with `profile` (py-spy
    may only trace its own descendants here, so it starts the server)."""
    port = free_port()
    cmd = [sys.executable, *s.argv, "--host", "127.0.0.1", "--port", str(port)]
    if profile is not None:
        spy = [
            str(Path(sys.executable).with_name("py-spy")),
            "record",
            "--format",
            "raw",
            "--subprocesses",
            "--threads",
            "--rate",
            "200",
            "-o",
            str(profile),
            "--",
        ]
        cmd = spy + cmd
    proc = subprocess.Popen(
        cmd,
        cwd=s.cwd,
        env=s.env,
        preexec_fn=pin(cpus),
        stdout=subprocess.DEVNULL if profile else None,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, startup_s, s.name)
        root = psutil.Process(proc.pid)
        if profile is not None:
            root = root.children()[0]
        wait_front_ends(root, s.front_ends)
        yield Running(s, proc, root, url)
    finally:
        _stop(proc, profile is not None)


def _stop(proc: subprocess.Popen[bytes], profiled: bool) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(psutil.Error, IndexError):
        # SIGTERM to the server, not py-spy: py-spy writes its profile once the server is gone.
        target = psutil.Process(proc.pid).children()[0].pid if profiled else proc.pid
        os.kill(target, signal.SIGTERM)
    try:
        proc.wait(150)  # py-spy writes its profile only once the whole tree is gone
    except subprocess.TimeoutExpired:
        for p in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                p.kill()
        proc.kill()
        proc.wait()


def _listens(p: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return any(c.status == psutil.CONN_LISTEN for c in p.net_connections("tcp"))
    return False


def role(p: psutil.Process, root: psutil.Process) -> str:
    """What a server process is: a front end listens on the port; with --workers N > 1 the root
    is the supervisor and the one other spawned child the engine."""
    if p.pid == root.pid:
        return "server" if _listens(p) else "supervisor"
    with contextlib.suppress(psutil.Error):
        if "resource_tracker" in " ".join(p.cmdline()):
            return "resource tracker"
    return "front end" if _listens(p) else "engine"


def tree_cpu(root: psutil.Process) -> dict[int, tuple[float, str]]:
    """CPU-seconds (user + system, all threads) of the process and every descendant now."""
    out = {}
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            out[p.pid] = (t.user + t.system, f"{role(p, root)} {p.pid}")
    return out


def wait_front_ends(root: psutil.Process, n: int, timeout_s: float = 120) -> None:
    """/readyz answers once one front end is up; load waits for all `n` (SO_REUSEPORT assigns a
    connection to the sockets bound when it opens, for its lifetime)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        procs = [root, *root.children(recursive=True)]
        if sum(_listens(p) for p in procs) >= n:
            return
        time.sleep(0.2)
    raise RuntimeError(f"{n} front ends not listening after {timeout_s:g} s")


def scrape(url: str) -> Samples | None:
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            return parse_metrics(r.read().decode())
    except (urllib.error.URLError, OSError, ValueError):
        return None


@contextlib.contextmanager
def affinity(cpus: set[int] | None) -> Iterator[None]:
    """This process (the load generator, and wrk as its child) on `cpus` for the block."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        yield
        return
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)


def split_cpus(client_cores: int) -> tuple[set[int] | None, set[int] | None]:
    """Server on the first cores, the load generator on the last `client_cores`."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) <= client_cores:
        return None, None
    return set(cores[:-client_cores]), set(cores[-client_cores:])


# ------------------------------------------------------------------------------------- load


def requests_of(kind: str) -> list[Request]:
    """8 variants of one payload kind: 640x480 sources; tensors are the 224x224 crops."""
    return build_requests(kind, load_images(None, (640, 480), 8), ModelInput.from_info({}))


def _wrk(url: str, req: Request, seconds: float, connections: int, threads: int) -> tuple[int, int]:
    """wrk's (requests answered, of them not 2xx) for a closed loop of `connections`."""
    with tempfile.TemporaryDirectory() as tmp:
        body = Path(tmp) / "body"
        body.write_bytes(req.body)
        headers = "".join(
            f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}\n" for k, v in req.headers.items()
        )
        script = Path(tmp) / "post.lua"
        script.write_text(
            f'wrk.method = "POST"\nlocal f = assert(io.open({json.dumps(str(body))}, "rb"))\n'
            f'wrk.body = f:read("*a")\nf:close()\n{headers}'
        )
        out = subprocess.run(
            [
                "wrk",
                f"-t{threads}",
                f"-c{max(connections, threads)}",
                f"-d{seconds:g}s",
                "--timeout",
                "10s",
                "-s",
                str(script),
                url + req.path,
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    done = re.search(r"(\d+) requests in", out)
    if not done:
        raise RuntimeError(f"unexpected wrk output: {out[:300]}")
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    failed = (int(bad.group(1)) if bad else 0) + (
        sum(int(g) for g in errors.groups()) if errors else 0
    )
    return int(done.group(1)), failed


def saturate(
    r: Running, reqs: Sequence[Request], seconds: float, connections: int, threads: int
) -> dict[str, Any]:
    """A closed loop at saturation: requests/s and the server tree's CPU per request."""
    before = scrape(r.url) if r.server.clipserve else None
    cpu0, usage0, t0 = tree_cpu(r.root), resource.getrusage(resource.RUSAGE_CHILDREN), time.time()
    if shutil.which("wrk"):
        answered, failed = _wrk(r.url, reqs[0], seconds, connections, threads)
    else:
        point = run_point(r.url, reqs, LoadSpec(concurrency=connections, duration_s=seconds))
        answered, failed = point.completed, point.completed - point.ok
    wall = time.time() - t0
    cpu1, usage1 = tree_cpu(r.root), resource.getrusage(resource.RUSAGE_CHILDREN)
    after = scrape(r.url) if r.server.clipserve else None
    per_process = {
        label: round(cpu - cpu0.get(pid, (0.0, ""))[0], 3) for pid, (cpu, label) in cpu1.items()
    }
    cpu = sum(per_process.values())
    ok = max(answered - failed, 1)
    row: dict[str, Any] = {
        "server": r.server.name,
        "requests": answered,
        "requests_per_s": round(answered / wall, 1),
        "failed": failed,
        "server_cpu_ms_per_request": round(cpu / ok * 1000, 4),
        "server_cores_busy": round(cpu / wall, 3),
        "client_cores_busy": round(
            (usage1.ru_utime - usage0.ru_utime + usage1.ru_stime - usage0.ru_stime) / wall, 3
        ),
        "cpu_s_by_process": per_process,
    }
    by_role: dict[str, float] = defaultdict(float)
    for label, cpu_s in per_process.items():
        by_role[label.rsplit(" ", 1)[0]] += cpu_s
    row["cpu_ms_per_request_by_role"] = {k: round(v / ok * 1000, 4) for k, v in by_role.items()}
    fronts = [v for k, v in per_process.items() if k.startswith("front end")]
    if len(fronts) > 1 and sum(fronts) > 0:  # how evenly the kernel spread the connections
        row["front_end_cpu_shares"] = sorted(round(v / sum(fronts), 3) for v in fronts)
    b = breakdown(before, after)
    if b is not None and b.images:
        busy_s = sum(ms * b.batches_by_device[d] for d, ms in b.batch_ms_by_device.items()) / 1000
        row["executor_wall_ms_per_request"] = round(busy_s / ok * 1000, 4)
        row["mean_batch_size"] = b.mean_batch_size
        row["server_statuses"] = {k: int(v) for k, v in b.requests_by_status.items()}
        row["server_stage_ms"] = b.stage_ms
    return row


def _clean(row: dict[str, Any]) -> bool:
    """A saturation point counts in the summaries if under 1% of its requests failed (the rows
    keep every point, failed ones included)."""
    return bool(row["failed"] <= 0.01 * row["requests"])


def spread(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
        "n": len(values),
    }


def rotated(items: Sequence[Any], by: int) -> list[Any]:
    """Each round starts with a different variant: drift on a shared machine spreads evenly."""
    k = by % len(items) if items else 0
    return [*items[k:], *items[:k]]


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def start_all(
    stack: contextlib.ExitStack, servers: Sequence[Server], cpus: set[int] | None
) -> tuple[list[Running], dict[str, str]]:
    """Every server that starts; the reason for each that does not (say, --workers 2 before the
    engine exists) instead of ending the run."""
    up, skipped = [], {}
    for s in servers:
        try:
            up.append(stack.enter_context(start(s, cpus)))
        except RuntimeError as e:
            skipped[s.name] = str(e)
            say(f"skipped {s.name}: {e}")
    return up, skipped


# ---------------------------------------------------------------------------------- profile


def summarise_profile(path: Path, top: int = 12) -> dict[str, Any]:
    """py-spy's raw (collapsed) stacks, per process: the share of samples per thread (the event
    loop is MainThread), the leaf functions (self) and the functions on the stack (inclusive)
    with the largest shares, and the event loop thread's own leaf functions and lines. Start-up
    stacks (imports, building the model) are dropped: only serving is summarised."""
    startup = (
        "_find_and_load",
        "build_runtime",
        "load_model",
        "create_model",
        "warmup",
        "tokenizer.py",
    )  # images only: the tokenizer shows up only in start-up
    kinds = ("self", "inclusive", "area", "thread", "loop_self", "loop_lines")
    procs: dict[str, dict[str, Counter[str]]] = defaultdict(lambda: {k: Counter() for k in kinds})
    totals: Counter[str] = Counter()
    frontend: set[str] = set()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        heads = list(re.finditer(r'process (\d+):"(.*?)";', stack))
        if not heads or not count.isdigit() or any(s in stack for s in startup):
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
        names = [re.sub(r":\d+\)$", ")", f) for f in frames]  # per function, not per line
        c = procs[pid]
        totals[pid] += n
        c["self"][names[-1]] += n
        for name in set(names):
            c["inclusive"][name] += n
        c["area"][_area(frames[-1])] += n
        c["thread"][thread] += n
        if thread == "MainThread" and not any(w in names[-1] for w in WAITING):
            c["loop_self"][names[-1]] += n
            c["loop_lines"][frames[-1]] += n
        if any("uvicorn" in f for f in frames):
            frontend.add(pid)
    out = {}
    for pid, total in totals.most_common():
        c = procs[pid]

        def share(counter: Counter[str], k: int = top) -> list[tuple[str, float]]:
            return [(name, round(v / total, 3)) for name, v in counter.most_common(k)]  # noqa: B023

        out[pid] = {
            "role": "front end (uvicorn)" if pid in frontend else "engine / supervisor",
            "samples": total,
            "shares_are_of": "all samples of this process",
            "by_thread": share(c["thread"], 8),
            "self": share(c["self"]),
            "inclusive": [x for x in share(c["inclusive"], 4 * top) if not _outer(x[0])][:top],
            "self_by_package": share(c["area"], 10),
            "waiting_or_in_c_loop": round(
                sum(v for k, v in c["self"].items() if any(w in k for w in WAITING)) / total, 3
            ),
            # of the event loop thread's samples not in WAITING frames:
            "event_loop_thread_busy_self": _shares(c["loop_self"], 2 * top),
            "event_loop_thread_busy_lines": _shares(c["loop_lines"], top),
        }
    return out


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


def _shares(counter: Counter[str], k: int) -> list[tuple[str, float]]:
    total = sum(counter.values()) or 1
    return [(name, round(v / total, 3)) for name, v in counter.most_common(k)]


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


def _outer(name: str) -> bool:
    return any(o in name for o in OUTER)


def _area(frame: str) -> str:
    m = re.search(r"\((.*?):\d+\)$", frame)
    file = m.group(1) if m else frame
    for key in (
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
    ):
        if f"/{key}/" in file or file.startswith(f"{key}/") or f"{key}.py" in file:
            return key
    return "other: " + file.rsplit("/", 1)[-1]


def profile(
    s: Server,
    cpus: set[int] | None,
    client: set[int] | None,
    reqs: Sequence[Request],
    seconds: float,
    connections: int,
    threads: int,
    out: Path,
) -> dict[str, Any]:
    with start(s, cpus, profile=out) as r, affinity(client):
        row = saturate(r, reqs, seconds, connections, threads)
    deadline = time.monotonic() + 30
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    summary = summarise_profile(out) if out.exists() else {}
    return {
        "under_py_spy": {k: row[k] for k in ("requests_per_s", "server_cores_busy")},
        "processes": summary,
    }


# --------------------------------------------------------------------------------- sections


def fake_flags(model: Path, *options: str) -> list[str]:
    flags = ["--backend", "fake", "--pretrained", "none", "--model", str(model), "--gpus", "cpu"]
    for o in ("compute=0", *options):
        flags += ["--backend-option", o]
    return flags


def decode_cost(jpegs: Sequence[Request], repeat: int = 60) -> float:
    """CPU ms to decode one of the JPEGs to a 224x224 crop, here (as the server's pool would)."""
    decoder = ImageDecoder(ModelInput.from_info({}).spec, 10**8)
    decoder(jpegs[0].body)
    t0 = time.process_time()
    for i in range(repeat):
        decoder(jpegs[i % len(jpegs)].body)
    return (time.process_time() - t0) / repeat * 1000


def section_cost(a: argparse.Namespace, model: Path) -> dict[str, Any]:
    server_cpus, client_cpus = split_cpus(a.client_cores)
    kinds = {"tensor": requests_of("raw-tensor"), "jpeg": requests_of("jpeg")}
    servers = [floor()] + [
        clipserve(f"clipserve-w{n}", [*fake_flags(model), "--workers", str(n)])
        for n in a.cost_workers
    ]
    if a.cost_before_tree:  # one process, as before issue 8 (its fake must know compute=0)
        servers.append(clipserve("clipserve-before", fake_flags(model), a.cost_before_tree))
    rows: list[dict[str, Any]] = []
    threads = len(client_cpus or {0})
    with contextlib.ExitStack() as stack, affinity(client_cpus):
        up, skipped = start_all(stack, servers, server_cpus)
        for r in up:  # warm-up: connections, caches, the batcher's first batches
            for reqs in kinds.values():
                saturate(r, reqs, 1.0, a.connections, threads)
        decode: list[float] = []  # per round, on the server's cores between load points
        for rnd in range(a.rounds):
            with affinity(server_cpus):
                decode.append(decode_cost(kinds["jpeg"]))
            for r in rotated(up, rnd):
                for kind, reqs in kinds.items():
                    row = {
                        "round": rnd,
                        "payload": kind,
                        **saturate(r, reqs, a.seconds, a.connections, threads),
                    }
                    rows.append(row)
                    say(
                        f"cost round {rnd} {r.server.name} {kind}: "
                        f"{row['requests_per_s']} req/s, "
                        f"{row['server_cpu_ms_per_request']} CPU ms/req"
                    )
    summary: dict[str, Any] = {}
    for r in up:
        for kind in kinds:
            mine = [
                x
                for x in rows
                if x["server"] == r.server.name and x["payload"] == kind and _clean(x)
            ]
            floors = {
                x["round"]: x for x in rows if x["server"] == "floor" and x["payload"] == kind
            }
            ms = [x["server_cpu_ms_per_request"] for x in mine]
            entry: dict[str, Any] = {
                "cpu_ms_per_request": spread(ms),
                "requests_per_s": spread([x["requests_per_s"] for x in mine]),
            }
            if r.server.name != "floor":
                own = [
                    x["server_cpu_ms_per_request"] - (decode[x["round"]] if kind == "jpeg" else 0)
                    for x in mine
                ]
                entry["event_loop_side_ms_per_request"] = spread(own)
                entry["event_loop_side_over_floor"] = spread(
                    [
                        o / floors[x["round"]]["server_cpu_ms_per_request"]
                        for o, x in zip(own, mine, strict=True)
                    ]
                )
                roles = sorted({k for x in mine for k in x.get("cpu_ms_per_request_by_role", {})})
                entry["cpu_ms_per_request_by_role"] = {
                    k: spread([x["cpu_ms_per_request_by_role"].get(k, 0.0) for x in mine])
                    for k in roles
                }
                entry["executor_wall_ms_per_request"] = spread(
                    [x.get("executor_wall_ms_per_request", 0.0) for x in mine]
                )
                if kind == "jpeg":
                    entry["decode_share_of_cpu"] = spread(
                        [decode[x["round"]] / x["server_cpu_ms_per_request"] for x in mine]
                    )
            summary[f"{r.server.name} {kind}"] = entry
    profiles = {}
    if a.profile_seconds > 0:
        with tempfile.TemporaryDirectory() as tmp:
            for s in servers[1:]:
                if s.name in skipped:
                    continue
                for kind in a.profile_payloads:
                    say(f"profiling {s.name} {kind}")
                    try:
                        profiles[f"{s.name} {kind}"] = profile(
                            s,
                            server_cpus,
                            client_cpus,
                            kinds[kind],
                            a.profile_seconds,
                            a.connections,
                            threads,
                            Path(tmp) / f"{s.name}-{kind}.txt",
                        )
                    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                        profiles[f"{s.name} {kind}"] = {"error": str(e)}
    return {
        "pinning": {
            "server_cpus": sorted(server_cpus or []),
            "client_cpus": sorted(client_cpus or []),
        },
        "client": "wrk" if shutil.which("wrk") else "clipserve-bench (aiohttp)",
        "connections": a.connections,
        "seconds_per_point": a.seconds,
        "decode_cpu_ms_per_jpeg_offline": spread(decode),
        "skipped": skipped,
        "summary_medians": summary,
        "rows": rows,
        "profiles": profiles,
    }


def section_batching(a: argparse.Namespace, model: Path) -> dict[str, Any]:
    server_cpus, client_cpus = split_cpus(a.client_cores)
    reqs = requests_of("raw-tensor")
    flags = fake_flags(model, f"latency_ms={a.batch_latency_ms}")
    servers = [clipserve(f"w{n}", [*flags, "--workers", str(n)]) for n in (1, a.batching_workers)]
    rows = []
    with contextlib.ExitStack() as stack, affinity(client_cpus):
        up, skipped = start_all(stack, servers, server_cpus)
        spec = LoadSpec(rate=a.batching_rate, duration_s=a.seconds * 2, warmup_s=1.0)
        for r in up:
            run_point(r.url, reqs, LoadSpec(rate=a.batching_rate, duration_s=1.0))
        for rnd in range(a.rounds):
            for r in rotated(up, rnd):
                p = run_point(r.url, reqs, spec)
                server = p.server or {}
                rows.append(
                    {
                        "round": rnd,
                        "server": r.server.name,
                        "mean_batch_size": server.get("mean_batch_size"),
                        "batched_share": server.get("batched_share"),
                        "images_per_s": p.images_per_s,
                        "latency_ms": p.latency_ms,
                        "statuses": p.statuses,
                        "warnings": p.warnings,
                    }
                )
                say(f"batching round {rnd} {r.server.name}: batch {server.get('mean_batch_size')}")
    by = {(x["round"], x["server"]): x for x in rows}
    many = f"w{a.batching_workers}"
    ratios = [
        by[(i, many)]["mean_batch_size"] / by[(i, "w1")]["mean_batch_size"]
        for i in range(a.rounds)
        if (i, many) in by and (i, "w1") in by
    ]
    med = spread(ratios)
    return {
        "offered_requests_per_s": a.batching_rate,
        "fake_batch_latency_ms": a.batch_latency_ms,
        "payload": "one raw uint8 224x224x3 tensor per request, Poisson arrivals",
        "skipped": skipped,
        "mean_batch_size": {
            s.name: spread(
                [
                    x["mean_batch_size"]
                    for x in rows
                    if x["server"] == s.name and x["mean_batch_size"]
                ]
            )
            for s in servers
        },
        f"{many}_over_w1": med,
        "within_10_percent": None if med is None else abs(med["median"] - 1) <= 0.10,
        "rows": rows,
    }


def section_scaling(a: argparse.Namespace, model: Path) -> dict[str, Any]:
    # Few cores: no pinning (front ends, engine and client share them all); else the client
    # keeps its --client-cores and the server gets the rest.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    server_cpus, client_cpus = split_cpus(a.client_cores) if cores >= 4 else (None, None)
    reqs = requests_of("raw-tensor")
    servers = [
        clipserve(f"w{n}", [*fake_flags(model), "--workers", str(n)]) for n in a.workers_list
    ]
    threads = len(client_cpus) if client_cpus else 1
    rows = []
    with contextlib.ExitStack() as stack, affinity(client_cpus):
        up, skipped = start_all(stack, servers, server_cpus)
        for r in up:
            saturate(r, reqs, 1.0, a.connections, threads)
        for rnd in range(a.rounds):
            for r in rotated(up, rnd):
                n = int(r.server.name[1:])
                conns = max(a.connections, 16 * n)
                row = {"round": rnd, "workers": n, **saturate(r, reqs, a.seconds, conns, threads)}
                rows.append(row)
                say(f"scaling round {rnd} w{n}: {row['requests_per_s']} req/s")
    rps = {
        n: [x["requests_per_s"] for x in rows if x["workers"] == n and _clean(x)]
        for n in a.workers_list
    }
    base = statistics.median(rps[1]) if rps.get(1) else None
    return {
        "pinning": {
            "server_cpus": sorted(server_cpus or []),
            "client_cpus": sorted(client_cpus or []),
        },
        "payload": "one raw uint8 224x224x3 tensor per request, closed loop",
        "skipped": skipped,
        "requests_per_s": {n: spread(v) for n, v in rps.items() if v},
        "of_linear": {
            n: round(statistics.median(v) / (n * base), 3) for n, v in rps.items() if v and base
        },
        "rows": rows,
    }


def _total(samples: Samples | None, name: str) -> float:
    return sum(v for (n, _), v in (samples or {}).items() if n == name)


def _histogram(before: Samples | None, after: Samples | None) -> dict[str, int]:
    """Batches per batch-size bucket (not cumulative) between two scrapes."""
    if before is None or after is None:
        return {}
    cum = sorted(
        (float(dict(labels)["le"]), v - before.get((name, labels), 0.0))
        for (name, labels), v in after.items()
        if name == "clipserve_batch_size_bucket"
    )
    out, prev = {}, 0.0
    for le, c in cum:
        if c - prev:
            out["+Inf" if le == float("inf") else f"<={le:g}"] = int(c - prev)
        prev = c
    return out


def section_policy(a: argparse.Namespace, model: Path) -> dict[str, Any]:
    """Batch policy and the no-regression check: one set of interleaved rounds."""
    from clipserve.config import BatchingConfig

    flags = [
        "--backend",
        "torch",
        "--pretrained",
        "none",
        "--model",
        str(model),
        "--gpus",
        "cpu",
        "--max-batch-size",
        "32",
    ]
    default = BatchingConfig().max_queue_delay_ms
    servers = []
    if a.before_tree:
        servers.append(clipserve("before", flags, a.before_tree))
    if default not in a.delays:
        servers.append(clipserve(f"after default ({default:g} ms)", [*flags, "--workers", "1"]))
    for d in a.delays:
        name = f"after {d:g} ms" + (" (default)" if d == default else "")
        servers.append(
            clipserve(name, [*flags, "--workers", "1", "--max-queue-delay-ms", f"{d:g}"])
        )
    reqs = requests_of("jpeg")
    rows = []
    with contextlib.ExitStack() as stack:
        up, skipped = start_all(stack, servers, None)
        for r in up:
            run_point(r.url, reqs, LoadSpec(concurrency=32, duration_s=2.0))
        spec = LoadSpec(concurrency=32, duration_s=a.policy_seconds, warmup_s=1.0)
        for rnd in range(a.rounds):
            for r in rotated(up, rnd):
                before, cpu0 = scrape(r.url), tree_cpu(r.root)
                p = run_point(r.url, reqs, spec)
                cpu1, after = tree_cpu(r.root), scrape(r.url)
                server = p.server or {}
                # Throughput here follows whatever else runs on the machine; server CPU per
                # image computed (warm-up included on both sides) much less so.
                cpu = sum(c - cpu0.get(pid, (0.0, ""))[0] for pid, (c, _) in cpu1.items())
                images = _total(after, "clipserve_batch_size_sum") - _total(
                    before, "clipserve_batch_size_sum"
                )
                rows.append(
                    {
                        "round": rnd,
                        "server": r.server.name,
                        "images_per_s": p.images_per_s,
                        "latency_ms": p.latency_ms,
                        "server_cpu_ms_per_image": round(cpu / images * 1000, 3)
                        if images
                        else None,
                        "mean_batch_size": server.get("mean_batch_size"),
                        "batch_size_histogram": _histogram(before, after),
                        "statuses": p.statuses,
                        "warnings": p.warnings,
                    }
                )
                say(
                    f"policy round {rnd} {r.server.name}: {p.images_per_s} img/s, "
                    f"p99 {p.latency_ms.get('p99')} ms"
                )
    summary = {}
    for s in servers:
        mine = [x for x in rows if x["server"] == s.name]
        if not mine:
            continue
        hist: Counter[str] = Counter()
        for x in mine:
            hist.update(x["batch_size_histogram"])
        summary[s.name] = {
            "images_per_s": spread([x["images_per_s"] for x in mine]),
            "p50_ms": spread([x["latency_ms"]["p50"] for x in mine]),
            "p99_ms": spread([x["latency_ms"]["p99"] for x in mine]),
            "mean_batch_size": spread([x["mean_batch_size"] or 0 for x in mine]),
            "server_cpu_ms_per_image": spread(
                [x["server_cpu_ms_per_image"] for x in mine if x.get("server_cpu_ms_per_image")]
            ),
            "batch_size_histogram_all_rounds": dict(hist),
        }
    default_name = next(
        (s.name for s in servers if s.name.startswith("after") and ("default" in s.name)), None
    )
    by = {(x["round"], x["server"]): x["images_per_s"] for x in rows}
    ratios = [
        by[(i, default_name)] / by[(i, "before")]
        for i in range(a.rounds)
        if (i, default_name) in by and by.get((i, "before"))
    ]
    per_image = {(x["round"], x["server"]): x.get("server_cpu_ms_per_image") or 0.0 for x in rows}
    cpu_ratios = [
        per_image[(i, default_name)] / per_image[(i, "before")]
        for i in range(a.rounds)
        if per_image.get((i, default_name)) and per_image.get((i, "before"))
    ]
    return {
        "model": "tiny open_clip (clipserve.loadgen.procs.TINY_CONFIG), random weights, torch CPU",
        "load": "closed loop, concurrency 32, 640x480 JPEG q90 (8 variants)",
        "before_tree": str(a.before_tree) if a.before_tree else None,
        "skipped": skipped,
        "summary_medians": summary,
        "regression": {
            "after_default_over_before_images_per_s": spread(ratios),
            "after_default_over_before_server_cpu_per_image": spread(cpu_ratios),
            "after": default_name,
        },
        "rows": rows,
    }


RUNNERS: dict[str, Callable[[argparse.Namespace, Path], dict[str, Any]]] = {
    "cost": section_cost,
    "batching": section_batching,
    "scaling": section_scaling,
    "policy": section_policy,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one round, short points")
    p.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help="any of " + ",".join(SECTIONS) + " (regression runs with policy)",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=5.0, help="per saturation point")
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--client-cores", type=int, default=1)
    p.add_argument("--cost-workers", default="1,2", help="front ends of the cost section")
    p.add_argument("--profile-seconds", type=float, default=5.0, help="0: no py-spy profile")
    p.add_argument("--profile-payloads", default="tensor")
    p.add_argument("--batching-workers", type=int, default=2)
    p.add_argument("--batching-rate", type=float, default=200.0, help="requests/s, open loop")
    p.add_argument("--batch-latency-ms", type=float, default=20.0)
    p.add_argument("--workers-list", default="1,2")
    p.add_argument("--before-tree", type=Path, help="a checkout of the commit before issue 8")
    p.add_argument(
        "--cost-before-tree", type=Path, help="cost section: also a checkout with fake compute=0"
    )
    p.add_argument("--delays", default="0,5,10", help="--max-queue-delay-ms values")
    p.add_argument("--policy-seconds", type=float, default=8.0)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    if a.quick:
        a.rounds, a.seconds, a.profile_seconds, a.policy_seconds = 1, 2.0, 3.0, 3.0
    a.cost_workers = [int(x) for x in a.cost_workers.split(",")]
    a.workers_list = [int(x) for x in a.workers_list.split(",")]
    a.delays = [float(x) for x in a.delays.split(",") if x]
    a.profile_payloads = [x for x in a.profile_payloads.split(",") if x]
    sections = [s.strip() for s in a.sections.split(",")]
    if "regression" in sections and "policy" not in sections:
        sections.append("policy")
    result: dict[str, Any] = {
        "benchmark": "front ends (--workers N)",
        "date": utc_now(),
        "machine": machine(),
        "note": "shared machine: other work ran beside it; points vary about ±20% run to run",
        "rounds": a.rounds,
        "git": subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
    }
    out = a.out or ROOT / "bench" / "results" / (
        f"frontend-{time.strftime('%Y-%m-%d')}-{machine_slug()}{'-quick' if a.quick else ''}.json"
    )
    with tempfile.TemporaryDirectory() as tmp:
        fake_model, tiny_model = Path(tmp) / "fake-512.json", Path(tmp) / "tiny.json"
        fake_model.write_text(json.dumps(FAKE_CONFIG))
        tiny_model.write_text(json.dumps(TINY_CONFIG))
        for name in (s for s in SECTIONS if s in sections and s in RUNNERS):
            say(f"section {name}")
            model = tiny_model if name == "policy" else fake_model
            result[name] = RUNNERS[name](a, model)
            out.write_text(json.dumps(result, indent=2) + "\n")  # a partial run still reports
    print(
        json.dumps(
            {
                k: v.get("summary_medians", v) if isinstance(v, dict) else v
                for k, v in result.items()
            },
            indent=1,
        )[:6000]
    )
    say(f"wrote {out}")


if __name__ == "__main__":
    main()
