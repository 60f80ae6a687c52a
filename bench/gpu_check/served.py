"""The served sections: clipserve on the device, driven by clipserve-bench over HTTP; uint8
tensors at each --pipeline-depth (the served_tensor and device_busy targets), single-image
tensor requests (whose rate one engine's loop may set: by its CPU on the development machine,
~30k requests/s, near the device's rate for ViT-B-32 FP16), and JPEGs, decoded on the device
where the server can (served_jpeg). The device-busy ratio and each process's CPU are read
inside the measured window, so a result says what ran out first."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import REPO
from bench.gpu_check.plan import Emit, Plan
from bench.gpu_check.proc_cpu import Snapshot, cores_busy, snapshot
from bench.metrics import has, scrape, total
from clipserve.loadgen.procs import clipserve_process

BUSY = "clipserve_device_busy_seconds_total"


@dataclass(frozen=True)
class Load:
    """clipserve-bench's closed loop for one payload."""

    kind: str  # clipserve-bench's --payload
    images_per_request: int
    concurrency: int
    procs: int
    duration_s: float
    warmup_s: float

    @classmethod
    def of(cls, payload: str, quick: bool) -> Load:
        kind = "msgpack-images" if payload == "jpeg" else "raw-tensor"
        if payload == "single":  # one image a request: the engine's per-request ceiling
            if quick:
                return cls(kind, 1, concurrency=8, procs=1, duration_s=4.0, warmup_s=1.0)
            # Batches of a few hundred images need that many requests in flight, and ~30k
            # requests/s more client processes than the other loads.
            return cls(kind, 1, concurrency=512, procs=6, duration_s=15.0, warmup_s=3.0)
        if quick:
            return cls(kind, 8, concurrency=4, procs=1, duration_s=4.0, warmup_s=1.0)
        per_request = 64 if payload == "tensor" else 16
        return cls(kind, per_request, concurrency=64, procs=4, duration_s=15.0, warmup_s=3.0)

    def body_bytes(self) -> int:
        """Room for every request's body at once, twice over: a load the server refuses with
        503 (--max-body-bytes-in-flight; the 256 MiB default took 64 requests of 9.6 MB tensors
        on the first GPU run) measures the refusals, not the path to the device. Never below the
        default."""
        return max(2 * self.concurrency * self.images_per_request * 224 * 224 * 3, 2**28)

    def command(self, url: str, report: Path) -> list[str]:
        cmd = [sys.executable, "-m", "clipserve.loadgen", "--url", url, "-q"]
        cmd += ["--payload", self.kind, "-b", str(self.images_per_request)]
        cmd += ["-c", str(self.concurrency), "--procs", str(self.procs)]
        cmd += ["--duration", str(self.duration_s), "--warmup", str(self.warmup_s)]
        return [*cmd, "--json", str(report)]


def server_flags(plan: Plan, flags_known: str, depth: int | None, gpu_decode: bool) -> list[str]:
    flags = ["--model", plan.model, "--pretrained", "none", "--gpus", plan.gpus]
    flags += ["--log-level", "info"]  # the section's log says how far startup got
    if plan.cuda:
        flags += ["--backend", "cuda-graphs", "--precision", "fp16"]
        flags += ["--max-batch-size", "256", "--max-queue-size", "8192"]
    else:
        flags += ["--backend", "torch", "--max-batch-size", "16", "--max-queue-size", "256"]
    if plan.workers > 1 and "--workers" in flags_known:
        flags += ["--workers", str(plan.workers)]
        if plan.reuse_port and "--reuse-port" in flags_known:
            flags.append("--reuse-port")  # connections spread evenly over the front ends
    if depth is not None:
        flags += ["--pipeline-depth", str(depth)]
    if gpu_decode:
        flags += ["--decode", "gpu"]
    return flags


def counters(url: str) -> dict[str, float]:
    """Device busy seconds (NaN where the server has no such counter), batch seconds and
    batches so far, and when they were read."""
    samples = scrape(url)
    return {
        "busy": total(samples, BUSY) if has(samples, BUSY) else float("nan"),
        "batch": total(samples, "clipserve_batch_duration_seconds_sum"),
        "batches": total(samples, "clipserve_batch_duration_seconds_count"),
        "t": time.monotonic(),
    }


def scrape_in_window(
    url: str,
    load: Load,
    scrapes: list[dict[str, float]],
    cpu: list[Snapshot],
    pids: tuple[int, int],
) -> None:
    """Two reads of the counters and of the CPU of the server's and the load generator's
    processes (`pids`) inside the measured window, away from its edges."""
    first = counters(url)
    while counters(url)["batches"] == first["batches"]:  # the load has begun
        time.sleep(0.2)
    time.sleep(load.warmup_s + 0.5)
    port = int(url.rsplit(":", 1)[1])
    server, generator = pids
    for wait_s in (0.0, max(0.5, load.duration_s - 1.5)):
        time.sleep(wait_s)
        scrapes.append(counters(url))
        cpu.append(snapshot(server, port, {"load generator": generator}))


def section_served(plan: Plan, emit: Emit, payload: str, depth: int | None) -> dict[str, Any]:
    help_cmd = [sys.executable, "-m", "clipserve", "--help"]
    known = subprocess.run(help_cmd, cwd=REPO, capture_output=True, text=True).stdout
    out: dict[str, Any] = {"payload": payload, "workers_asked": plan.workers}
    if depth is not None and "--pipeline-depth" not in known:
        out["pipeline_depth"] = "not available (no --pipeline-depth flag)"
        depth = None
    gpu_decode = payload == "jpeg" and plan.cuda and "--decode" in known
    out["decode"] = "gpu" if gpu_decode else "cpu (pool)"
    load = Load.of(payload, plan.quick)
    flags = server_flags(plan, known, depth, gpu_decode)
    if "--max-body-bytes-in-flight" in known:
        flags += ["--max-body-bytes-in-flight", str(load.body_bytes())]
    out["server_flags"] = flags
    out["workers"] = plan.workers if "--workers" in flags else 1
    scrapes: list[dict[str, float]] = []
    cpu: list[Snapshot] = []
    with clipserve_process(flags, startup_s=300) as (server, url):
        report = Path(plan.out_dir) / f"loadgen-{payload}-{depth}.json"
        gen = subprocess.Popen(
            load.command(url, report),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        args = (url, load, scrapes, cpu, (server.pid, gen.pid))
        scraper = threading.Thread(target=scrape_in_window, args=args, daemon=True)
        scraper.start()
        _, err = gen.communicate()
        scraper.join(timeout=30)
        if gen.returncode != 0 or not report.exists():
            raise RuntimeError(f"clipserve-bench exited {gen.returncode}: {err[-800:]}")
    point = json.loads(report.read_text())["results"][0]
    out["pipeline_depth"] = depth if depth is not None else out.get("pipeline_depth")
    out["images_per_request"] = load.images_per_request
    out["concurrency"] = load.concurrency
    keys = ("images_per_s", "requests_per_s", "latency_ms", "statuses", "server")
    out.update({k: point[k] for k in keys})
    answered = sum(point["statuses"].values())
    # Refusals mean the load outran an admission limit: the rate is then not the device path's.
    out["not_200_share"] = round(1 - point["statuses"].get("200", 0) / max(answered, 1), 3)
    out.update(device_busy(scrapes))
    # Which ran out first, over device_busy's window: the engine's loop thread (near 1), the
    # front ends (near --workers), the load generator (near its --procs), the host (near its
    # cores) or the device.
    if len(scrapes) == 2 and len(cpu) == 2:
        out["cores_busy"] = cores_busy(cpu[0], cpu[1], scrapes[1]["t"] - scrapes[0]["t"])
    else:
        out["cores_busy"] = "not available (no reads inside the window)"
    return out


def device_busy(scrapes: list[dict[str, float]]) -> dict[str, Any]:
    """The device-busy ratio between the two reads: from the busy counter where the server has
    one, else batch time over wall."""
    if len(scrapes) != 2:
        return {"device_busy": "not available (no scrape inside the window)"}
    (a, b), wall = scrapes, scrapes[1]["t"] - scrapes[0]["t"]
    busy = (b["busy"] - a["busy"]) / wall
    # Batch time over wall counts overlapping batches twice: exact for a sequential worker.
    out: dict[str, Any] = {"batch_time_over_wall": round((b["batch"] - a["batch"]) / wall, 3)}
    if busy == busy:  # not NaN: the server has the busy counter
        out["device_busy"], out["device_busy_source"] = round(busy, 3), "device_busy_seconds"
    else:
        out["device_busy"] = out["batch_time_over_wall"]
        out["device_busy_source"] = "batch time / wall (no clipserve_device_busy_seconds)"
    return out
