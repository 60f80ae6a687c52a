"""Load on a running server: the payloads, a closed loop at saturation (wrk where installed, else
clipserve-bench's aiohttp client) with the server tree's CPU per request, and the summaries."""

from __future__ import annotations

import json
import re
import resource
import shutil
import subprocess
import tempfile
import time
import urllib.error
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import common
from bench.frontend.servers import Running, tree_cpu, tree_faults
from bench.metrics import scrape
from clipserve.loadgen.images import load_images
from clipserve.loadgen.loadgen import LoadSpec
from clipserve.loadgen.payloads import ModelInput, Request, build_requests
from clipserve.loadgen.runner import run_point
from clipserve.loadgen.server import Samples, breakdown


def requests_of(kind: str) -> list[Request]:
    """8 variants of one payload kind: 640x480 sources; tensors are the 224x224 crops."""
    return build_requests(kind, load_images(None, (640, 480), 8), ModelInput.from_info({}))


def client() -> str:
    return "wrk" if shutil.which("wrk") else "clipserve-bench (aiohttp)"


def metrics(r: Running) -> Samples | None:
    """The server's metrics now; None for the floor, or where they cannot be read."""
    if not r.server.clipserve:
        return None
    try:
        return scrape(r.url)
    except (urllib.error.URLError, OSError, ValueError):
        return None


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
        cmd = ["wrk", f"-t{threads}", f"-c{max(connections, threads)}", f"-d{seconds:g}s"]
        cmd += ["--timeout", "10s", "-s", str(script), url + req.path]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    done = re.search(r"(\d+) requests in", out)
    if not done:
        raise RuntimeError(f"unexpected wrk output: {out[:300]}")
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    failed = int(bad.group(1)) if bad else 0
    if errors:
        failed += sum(int(g) for g in errors.groups())
    return int(done.group(1)), failed


def _client_cpu_s() -> float:
    """CPU-seconds of this process's waited-for children (wrk) so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def saturate(
    r: Running, reqs: Sequence[Request], seconds: float, connections: int, threads: int
) -> dict[str, Any]:
    """A closed loop at saturation: requests/s and the server tree's CPU per request."""
    before = metrics(r)
    faults0 = tree_faults(r.root)
    cpu0, client0, t0 = tree_cpu(r.root), _client_cpu_s(), time.time()
    if shutil.which("wrk"):
        answered, failed = _wrk(r.url, reqs[0], seconds, connections, threads)
    else:
        point = run_point(r.url, reqs, LoadSpec(concurrency=connections, duration_s=seconds))
        answered, failed = point.completed, point.completed - point.ok
    wall = time.time() - t0
    cpu1, client1 = tree_cpu(r.root), _client_cpu_s()
    faults = tree_faults(r.root) - faults0
    after = metrics(r)
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
        "client_cores_busy": round((client1 - client0) / wall, 3),
        "page_faults_per_request": round(faults / ok, 2),
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


def clean(row: dict[str, Any]) -> bool:
    """A saturation point counts in the summaries if under 1% of its requests failed (the rows
    keep every point, failed ones included)."""
    return bool(row["failed"] <= 0.01 * row["requests"])


def spread(values: Sequence[float]) -> dict[str, float] | None:
    """Median, min and max over the rounds, and how many; None where there are none."""
    return {**common.spread(values, 4), "n": len(values)} if values else None
