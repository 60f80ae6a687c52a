"""Whether a server's memory, fds, threads and /dev/shm use stay bounded under long mixed
traffic, errors included.

clipserve (fake backend, latency_ms=1, compute=0; --cache-mb 8: the cache fills and evicts in
the warm-up) on one core, this client on the other; 32 connections send a weighted mix for
--warmup-s, then --minutes: raw-tensor and JPEG POST /embed (every body distinct, so cache keys
keep changing), OpenAI /v1/embeddings and KServe v2 JSON infer of random texts, and bad input:
a tensor of the wrong length (400), a wrong Content-Type (415), a Content-Length over
--max-body-bytes (413), malformed JSON (400), an unknown path (404), X-Request-Timeout-Ms: 1
(408, 503 or 504), a raw client that sends headers and part of a body, then closes. Outcomes
are counted by (kind, status): any other status is a finding. Every --sample-s, each server
process's RSS, USS, anonymous RSS, fds and threads, and the server's /dev/shm bytes; per role,
the value at the end of the warm-up and at the end, the max, the least-squares slope in MiB/min
after the warm-up and over its second half alone (a plateau or a leak). After each config:
none of its processes or /dev/shm files left.

    python -m bench.soak --minutes 4 --out bench/results/soak-2026-11-27.json   # both configs
    python -m bench.soak --workers 2 --minutes 15 --tracemalloc 1               # find a growth

--tracemalloc N: each server process traces N frames (a sitecustomize in a temp dir) and at the
end of the warm-up, half-way and at the end notes glibc's heap (mallinfo2) and a snapshot; the
report has the sites that grew most from the first to the last, file:line (RSS then includes
tracemalloc's own memory).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import string
import struct
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import psutil  # type: ignore[import-untyped]

from bench.common import REPO, machine, say, utc_now, write_report
from bench.frontend.cli import FAKE_CONFIG
from bench.frontend.load import requests_of
from bench.frontend.servers import affinity, clipserve, fake_flags, role, split_cpus, start
from clipserve.engine.slots import segment_prefix, shm_dir
from clipserve.loadgen.images import jpeg

MIB = 1 << 20
# The raw-tensor request every front-end bench sends (one 224x224 crop): its headers, and its
# body as the base each tensor here varies.
_TENSOR = requests_of("raw-tensor")[0]
TENSOR_HEADERS = dict(_TENSOR.headers)
TENSOR = len(_TENSOR.body)
# Request kinds, their rough weights, and the statuses each may get ("closed": no answer read).
MIX: dict[str, tuple[int, frozenset[str]]] = {
    "tensor": (30, frozenset({"200"})),
    "jpeg": (20, frozenset({"200"})),
    "openai-text": (15, frozenset({"200"})),
    "kserve-text": (8, frozenset({"200"})),
    "bad-tensor-length": (4, frozenset({"400"})),
    "bad-content-type": (4, frozenset({"415"})),
    "too-large": (3, frozenset({"413"})),
    "bad-json": (4, frozenset({"400"})),
    "not-found": (4, frozenset({"404"})),
    # 408 body_timeout: the deadline passed while the body was still arriving (docs/api.md)
    "timeout-1ms": (4, frozenset({"408", "503", "504"})),
    "partial-body": (4, frozenset({"closed"})),
}
# In every server process: tracemalloc from the start; per trigger file, a snapshot and glibc's
# heap totals (mallinfo2: "uordblks" in use, "fordblks" free but kept, "hblkhd" mmapped).
SITECUSTOMIZE = """\
import ctypes, json, os, threading, time, tracemalloc
_FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
class _Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in _FIELDS]
def _watch(where):
    mallinfo2, done = ctypes.CDLL(None).mallinfo2, set()
    mallinfo2.restype = _Info
    while True:
        time.sleep(0.5)
        for name in sorted(n for n in set(os.listdir(where)) - done if n.startswith("take-")):
            done.add(name)
            out, m = os.path.join(where, f"{os.getpid()}-{name[5:]}"), mallinfo2()
            with open(out + ".malloc", "w") as f:
                json.dump({n: getattr(m, n) for n in _FIELDS}, f)
            tracemalloc.take_snapshot().dump(out + ".tmp")
            os.replace(out + ".tmp", out + ".snap")
if where := os.environ.get("SOAK_TRACEMALLOC_DIR"):
    tracemalloc.start(int(os.environ["SOAK_TRACEMALLOC_FRAMES"]))
    threading.Thread(target=_watch, args=(where,), name="soak-tracemalloc", daemon=True).start()
"""


class Payloads:
    """Request bodies that differ every time (a counter in a tensor's first bytes, a JPEG
    comment segment), so the cache keeps missing and evicting."""

    def __init__(self, max_body: int, model: str) -> None:
        self.rng = random.Random(0)
        self.base = _TENSOR.body
        sizes = [(320, 240), (640, 480), (256, 256), (480, 640)]
        self.jpegs = [jpeg(*sizes[s % 4], seed=s) for s in range(48)]
        self.max_body, self.model, self.n = max_body, model, 0

    def tensor(self) -> bytes:
        self.n += 1
        return struct.pack("<Q", self.n) + self.base[8:]

    def jpeg(self) -> bytes:
        self.n += 1
        data = self.rng.choice(self.jpegs)
        comment = b"soak %d" % self.n
        return data[:2] + b"\xff\xfe" + struct.pack(">H", len(comment) + 2) + comment + data[2:]

    def text(self) -> str:
        n = self.rng.randint(3, 60)
        return "".join(self.rng.choices(string.ascii_lowercase + "  ", k=n)).strip() or "x"


async def _raw(url: str, head: bytes, body: bytes, answer: bool) -> str:
    """A request over a socket of its own: the status line's code, or "closed" when the
    connection is dropped after `body` without reading an answer."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head + body)
        await writer.drain()
        if not answer:
            return "closed"
        line = await asyncio.wait_for(reader.readline(), 10)
        return line.split()[1].decode() if line.startswith(b"HTTP/") else "no-status"
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def send(s: aiohttp.ClientSession, url: str, kind: str, p: Payloads) -> str:
    """One request of `kind`; its status as text."""
    post: tuple[str, bytes, dict[str, str]]
    json_ct = {"Content-Type": "application/json"}
    if kind == "tensor":
        post = ("/embed", p.tensor(), TENSOR_HEADERS)
    elif kind == "jpeg":
        post = ("/embed", p.jpeg(), {"Content-Type": "image/jpeg"})
    elif kind == "openai-text":
        texts = [p.text() for _ in range(p.rng.randint(1, 3))]
        post = ("/v1/embeddings", json.dumps({"model": p.model, "input": texts}).encode(), json_ct)
    elif kind == "kserve-text":
        one = {"name": "text", "shape": [1], "datatype": "BYTES", "data": [p.text()]}
        body = json.dumps({"inputs": [one]}).encode()
        post = (f"/v2/models/{p.model}-text/infer", body, json_ct)
    elif kind == "bad-tensor-length":
        post = ("/embed", p.base[: p.rng.randint(1, TENSOR - 1)], TENSOR_HEADERS)
    elif kind == "bad-content-type":
        post = ("/embed", p.tensor()[:4096], {"Content-Type": "text/plain"})
    elif kind == "bad-json":
        post = ("/v1/embeddings", b'{"model": "x", "input": ["a', json_ct)
    elif kind == "not-found":
        post = (f"/nowhere/{p.rng.randint(0, 999)}", b"{}", json_ct)
    elif kind == "timeout-1ms":
        post = ("/embed", p.tensor(), {**TENSOR_HEADERS, "X-Request-Timeout-Ms": "1"})
    elif kind == "too-large":
        head = "POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n"
        head += f"Content-Length: {p.max_body + 1}\r\n\r\n"
        return await _raw(url, head.encode(), p.jpegs[0][:4096], answer=True)
    else:  # partial-body: headers and part of a tensor, then the socket closes
        lines = "".join(f"{k}: {v}\r\n" for k, v in TENSOR_HEADERS.items())
        head = f"POST /embed HTTP/1.1\r\nHost: x\r\n{lines}Content-Length: {TENSOR}\r\n\r\n"
        return await _raw(url, head.encode(), p.tensor()[: p.rng.randint(0, TENSOR - 1)], False)
    async with s.post(url + post[0], data=post[1], headers=post[2]) as r:
        await r.read()
        return str(r.status)


async def drive(url: str, p: Payloads, connections: int, warmup_s: float, total_s: float) -> Any:
    """The closed loop: `connections` clients, each sending kinds drawn by weight until
    `total_s`; outcomes counted apart before and after `warmup_s`."""
    kinds, weights = list(MIX), [w for w, _ in MIX.values()]
    counts: dict[str, Counter[str]] = {"warmup": Counter(), "measured": Counter()}
    t0 = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=30)
    conn = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:

        async def client() -> None:
            while (now := time.monotonic() - t0) < total_s:
                kind = p.rng.choices(kinds, weights)[0]
                try:
                    status = await send(s, url, kind, p)
                except (aiohttp.ClientError, OSError, TimeoutError) as e:
                    status = f"error:{type(e).__name__}"
                phase = "warmup" if now < warmup_s else "measured"
                counts[phase][f"{kind} {status}"] += 1

        await asyncio.gather(*(client() for _ in range(connections)))
    return counts


def _status_kib(pid: int) -> dict[str, int]:
    """RssAnon (the heap, what a leak grows) and RssShmem (mapped slot files) from /proc."""
    with open(f"/proc/{pid}/status") as f:
        fields = [line.partition(":") for line in f]
    return {k: int(v.split()[0]) for k, _, v in fields if k in ("RssAnon", "RssShmem")}


def shm_use(supervisor: int) -> dict[str, int]:
    """The server's files in /dev/shm (named for its supervisor): count, bytes allocated (what
    the memory holds) and apparent size (slot files are sparse)."""
    stats = []
    for path in shm_dir().glob(f"{segment_prefix(supervisor)}*"):
        with contextlib.suppress(OSError):
            stats.append(path.stat())
    allocated, apparent = sum(x.st_blocks * 512 for x in stats), sum(x.st_size for x in stats)
    return {"files": len(stats), "allocated": allocated, "apparent": apparent}


class Sampler(threading.Thread):
    """Every `period` s: each server process's memory, fds and threads, and /dev/shm."""

    def __init__(self, root: psutil.Process, period: float, t0: float) -> None:
        super().__init__(daemon=True)
        self.root, self.period, self.t0 = root, period, t0
        self.labels: dict[int, str] = {}
        self.samples: list[dict[str, Any]] = []
        self.stop = threading.Event()

    def _label(self, p: psutil.Process) -> str:
        if p.pid not in self.labels:  # once per pid: a role takes socket lookups
            r = role(p, self.root)
            n = sum(v.startswith(r) for v in self.labels.values())  # a second engine: a restart
            self.labels[p.pid] = f"{r} {n + 1}" if r == "front end" or n else r
        return self.labels[p.pid]

    def sample(self) -> None:
        procs: dict[str, dict[str, float]] = {}
        for p in [self.root, *self.root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error, OSError):
                m, status = p.memory_full_info(), _status_kib(p.pid)
                procs[self._label(p)] = {
                    "rss": m.rss / MIB,
                    "uss": m.uss / MIB,
                    "anon": status.get("RssAnon", 0) / 1024,
                    "shmem": status.get("RssShmem", 0) / 1024,
                    "fds": p.num_fds(),
                    "threads": p.num_threads(),
                }
        t = time.monotonic() - self.t0
        self.samples.append({"t": t, "procs": procs, "shm": shm_use(self.root.pid)})

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            self.stop.wait(self.period)


def slope(ts: list[float], ys: list[float]) -> float | None:
    """Least squares, per minute; None under 3 points."""
    return float(np.polyfit(np.array(ts) / 60, ys, 1)[0]) if len(ts) >= 3 else None


MALLINFO = ("uordblks", "hblkhd")  # in use, mmapped (free heap holds earlier snapshots' too)
STATS = ("warmup_end", "end", "max", "slope_mib_per_min", "slope_second_half")


def summarise(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, Any]:
    after = [x for x in samples if x["t"] >= warmup_s]
    if not after:
        return {}
    half = after[len(after) // 2 :]
    labels = sorted({k for x in after for k in x["procs"]})
    roles: dict[str, Any] = {}
    for label in labels:
        mine = [x for x in after if label in x["procs"]]
        series = {k: [x["procs"][label][k] for x in mine] for k in mine[0]["procs"][label]}
        ts = [x["t"] for x in mine]
        ht = [x["t"] for x in half if label in x["procs"]]
        entry: dict[str, Any] = {"samples": len(mine)}
        for k in ("rss", "uss", "anon", "shmem"):
            ys, s, hs = series[k], slope(ts, series[k]), slope(ht, series[k][-len(ht) :])
            rounded = [None if v is None else round(v, 3) for v in (ys[0], ys[-1], max(ys), s, hs)]
            entry[f"{k}_mib"] = dict(zip(STATS, rounded, strict=True))
            minutes = {int((t - ts[0]) // 60): round(y, 1) for t, y in zip(ts, ys, strict=True)}
            entry[f"{k}_mib"]["last_of_each_minute"] = list(minutes.values())
        for k in ("fds", "threads"):
            ys = series[k]
            entry[k] = {"warmup_end": ys[0], "end": ys[-1], "min": min(ys), "max": max(ys)}
        roles[label] = entry
    shm = {
        k: {"min": min(x["shm"][k] for x in after), "max": max(x["shm"][k] for x in after)}
        for k in ("files", "allocated", "apparent")
    }
    return {"roles": roles, "shm_bytes": shm}


@contextlib.contextmanager
def stderr_to(path: Path) -> Iterator[None]:
    """This process's fd 2 into `path` for the block: a server started in it logs there."""
    sys.stderr.flush()
    saved, fd = os.dup(2), os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def tracemalloc_report(snaps: Path, pids: dict[int, str], top: int) -> dict[str, Any]:
    """Per process, the allocation sites that grew most from the first snapshot to the last."""
    out: dict[str, Any] = {}
    for pid, label in pids.items():
        files = sorted(snaps.glob(f"{pid}-*.snap"))
        if len(files) < 2:
            continue
        ends, keep = (files[0], files[-1]), [tracemalloc.Filter(False, tracemalloc.__file__)]
        first, last = (tracemalloc.Snapshot.load(str(f)).filter_traces(keep) for f in ends)
        diff = last.compare_to(first, "lineno")
        heaps = [json.loads(f.with_suffix(".malloc").read_text()) for f in ends]
        out[label] = {
            "malloc_mib": {k: [round(h[k] / MIB, 1) for h in heaps] for k in MALLINFO},
            "traced_mib": [
                round(sum(s.size for s in x.statistics("filename")) / MIB, 2) for x in (first, last)
            ],
            "top_growth": [  # site: KiB grown (blocks grown), KiB held at the end
                f"{d.traceback[0].filename}:{d.traceback[0].lineno}: {d.size_diff / 1024:+.1f} "
                f"KiB ({d.count_diff:+d}), {d.size / 1024:.1f} KiB"
                for d in diff[:top]
            ],
        }
    return out


def trigger(snaps: Path, name: str, pids: list[int], wait_s: float = 120) -> None:
    """A snapshot in every server process; waits until each has written it."""
    (snaps / f"take-{name}").touch()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if all((snaps / f"{p}-{name}.snap").exists() for p in pids if psutil.pid_exists(p)):
            return
        time.sleep(0.5)
    say(f"tracemalloc snapshot {name}: not every process wrote one in {wait_s:g} s")


def run_config(a: argparse.Namespace, workers: int, model: Path, tmp: Path) -> dict[str, Any]:
    server_cpus, client_cpus = split_cpus(1)
    flags = [*fake_flags(model, "latency_ms=1"), "--workers", str(workers), "--cache-mb", "8"]
    server = clipserve(f"clipserve-w{workers}", flags)
    snaps = tmp / f"snaps-w{workers}"
    if a.tracemalloc:
        hook = tmp / "hook"
        hook.mkdir(exist_ok=True)
        (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
        snaps.mkdir()
        path = os.pathsep.join(x for x in (str(hook), os.environ.get("PYTHONPATH")) if x)
        env = {**os.environ, "PYTHONPATH": path, "SOAK_TRACEMALLOC_DIR": str(snaps)}
        env["SOAK_TRACEMALLOC_FRAMES"] = str(a.tracemalloc)
        server = dataclasses.replace(server, env=env)
    log = tmp / f"server-w{workers}.log"
    out: dict[str, Any] = {"workers": workers, "server_argv": server.argv}
    total_s = a.warmup_s + a.minutes * 60
    with contextlib.ExitStack() as stack:
        with stderr_to(log):
            running = stack.enter_context(start(server, server_cpus))
        with urllib.request.urlopen(running.url + "/info", timeout=10) as r:
            info = json.load(r)
        payloads = Payloads(info["limits"]["max_body_bytes"], info["model_name"])
        say(f"w{workers}: serving at {running.url}; load for {total_s:g} s")
        sampler = Sampler(running.root, a.sample_s, time.monotonic())
        sampler.start()
        tree = [running.root, *running.root.children(recursive=True)]
        half = a.warmup_s + a.minutes * 30
        at = {"1-warmup": a.warmup_s, "2-half": half} if a.tracemalloc else {}
        pids = [p.pid for p in tree]
        marks = [threading.Timer(t, trigger, (snaps, n, pids)) for n, t in at.items()]
        for m in marks:
            m.start()
        t0 = time.monotonic()
        with affinity(client_cpus):
            counts = asyncio.run(drive(running.url, payloads, a.connections, a.warmup_s, total_s))
        wall = time.monotonic() - t0
        for m in marks:
            m.join()
        sampler.stop.set()
        sampler.join()
        seen = {p.pid: p for p in [running.root, *running.root.children(recursive=True), *tree]}
        if a.tracemalloc:
            trigger(snaps, "3-end", list(seen))
            out["tracemalloc"] = tracemalloc_report(snaps, sampler.labels, a.top)
    out.update(summarise(sampler.samples, a.warmup_s))
    measured = counts["measured"]
    kind_status = [(k, *k.rsplit(" ", 1)) for c in counts.values() for k in c]
    odd = {k for k, kind, status in kind_status if status not in MIX[kind][1]}
    unexpected = {k: sum(c[k] for c in counts.values()) for k in sorted(odd)}
    out |= {
        "outcomes_warmup": dict(sorted(counts["warmup"].items())),
        "outcomes_measured": dict(sorted(measured.items())),
        "unexpected": unexpected,
        "requests_per_s_measured": round(sum(measured.values()) / max(wall - a.warmup_s, 1e-9), 1),
        "roles_by_pid": {str(k): v for k, v in sampler.labels.items()},
        "cleanup": cleanup(seen, running.root.pid),
        "server_log": log_summary(log),
    }
    return out


def _alive(p: psutil.Process) -> bool:
    try:
        return bool(p.is_running() and p.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def cleanup(seen: dict[int, psutil.Process], supervisor: int, wait_s: float = 15) -> Any:
    """After the server stopped: its processes still running after `wait_s` (killed, and
    reported; a zombie is gone) and its files left in /dev/shm (removed, and reported)."""
    deadline, left = time.monotonic() + wait_s, list(seen.values())
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [p for p in left if _alive(p)]
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    files = sorted(str(x) for x in shm_dir().glob(f"{segment_prefix(supervisor)}*"))
    for f in files:
        Path(f).unlink(missing_ok=True)
    return {"processes_left": [p.pid for p in left], "shm_files_left": files}


def log_summary(log: Path) -> dict[str, Any]:
    """The server's log (--log-level warning): lines by level, tracebacks, the commonest
    messages (startup's random-weights warnings aside)."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    levels = Counter(w for x in lines for w in ("WARNING", "ERROR", "CRITICAL") if f" {w} " in x)
    quiet = ("RANDOM weights", "No pretrained weights")
    common = Counter(x[:200] for x in lines if not any(q in x for q in quiet)).most_common(15)
    return {
        "lines": len(lines),
        "levels": dict(levels),
        "tracebacks": sum("Traceback" in x for x in lines),
        "commonest": [f"{n}x {m}" for m, n in common],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    assert __doc__
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="1,2", help="configs: --workers values, in turn")
    p.add_argument("--minutes", type=float, default=4.0, help="measured, after the warm-up")
    p.add_argument("--warmup-s", type=float, default=30.0)
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--sample-s", type=float, default=2.0)
    p.add_argument("--tracemalloc", type=int, default=0, help="N frames; 0: off")
    p.add_argument("--top", type=int, default=15, help="allocation sites per process")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    a.workers = [int(x) for x in a.workers.split(",") if x]
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    git = ["git", "describe", "--always", "--dirty"]
    report: dict[str, Any] = {
        "benchmark": "soak: memory, fds, threads and /dev/shm under long mixed traffic",
        "date": utc_now(),
        "machine": machine(),
        "git": subprocess.run(git, cwd=REPO, capture_output=True, text=True).stdout.strip(),
        "settings": {k: v for k, v in vars(a).items() if k != "out"} | {"out": str(a.out)},
        "mix": {k: {"weight": w, "expected": sorted(e)} for k, (w, e) in MIX.items()},
        "note": "shared 2-core machine: server on one core, client on the other",
        "configs": {},
    }
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        model = Path(tmp) / "fake-512.json"
        model.write_text(json.dumps(FAKE_CONFIG))
        for n in a.workers:
            say(f"config --workers {n}")
            report["configs"][f"workers-{n}"] = run_config(a, n, model, Path(tmp))
            if a.out is not None:  # a partial run still reports
                a.out.write_text(json.dumps(report, indent=2) + "\n")
    write_report(report, a.out)


if __name__ == "__main__":
    main()
