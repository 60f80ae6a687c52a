"""One command on a CUDA machine: every GPU path, measured, into one JSON.

    python -m bench.gpu_check [--workers 1] [--budget-s 1200]      (or: make gpu-check)
    python -m bench.gpu_check --allow-cpu --quick                   (no GPU: the tiny model)

Sections, each in its own process with its own time limit (a CUDA error or a hang in one cannot
take the others down; one that fails or runs out of time is recorded with its log's tail and
whatever it measured so far, and the run goes on):
  env               versions, the GPU, which optional packages import
  gpu-tests         `pytest -m gpu` over the test files that hold GPU tests
  executor:<name>   offline sweep, batch 1..1024, FP16: torch eager, torch.compile, cuda-graphs,
                    ort-cuda (where onnxruntime-gpu's CUDA provider loads)
  decoders          nvJPEG (inference/gpu_decode.py) against Pillow per core, 640x480 JPEGs
  served:tensor-dN  served uint8-tensor rate through clipserve-bench and the device-busy ratio
                    (Δ clipserve_device_busy_seconds / wall, else Δ batch time / wall), one per
                    --pipeline-depth given where the server has that flag
  served:jpeg       served JPEG rate (with --decode gpu where the server has that flag)
The whole run keeps within --budget-s (default 20 minutes): a section starts with what is left
of its own limit and the budget, and is skipped when too little is left. Writes
bench/results/gpu-check-<gpu>-<date>.json (cpu-<cpu> without a GPU).

On the lent H100/H200 hosts (no network there; their image has torch, torchvision, onnx,
onnxruntime (CPU), onnxscript, numpy, pillow, aiohttp, msgpack, prometheus-client, anyio, h11,
click, httpx, pytest, pytest-timeout, uvloop, regex, timm, huggingface-hub, safetensors),
carry this wheel set (9 wheels, 3.4 MB; hdrhistogram's pbr and setuptools requirements are for
its build, not its import), downloaded here at the repository root first:

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \\
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \\
      starlette==1.10.0 uvicorn==0.54.0 httptools==0.9.0 open_clip_torch==3.3.0 ftfy==6.3.1 \\
      wcwidth==0.9.4 orjson==3.13.0 python-multipart==0.0.34 hdrhistogram==0.10.8
    # optional (ort-cuda; 255 MB, over one call's 64 MiB carry limit alone): onnxruntime-gpu

and run it there (device tool: carry [".whl"]). One call runs at most 10 minutes, so split the
sections with --only and join them with --merge, copying each call's JSON from $OUT into
bench/results/ before the next call (a section left out by the budget is listed "skipped"):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:. || exit; \\
    PYTHONUNBUFFERED=1 python3 -m bench.gpu_check --only env,gpu-tests,executor:torch \\
      --budget-s 570 --out $OUT/gpu-check.json
    # copy it to bench/results/gpu-check-h100.json, then, in the second call:
    ... python3 -m bench.gpu_check --only executor:cuda-graphs,decoders,served \\
      --budget-s 570 --merge bench/results/gpu-check-h100.json --out $OUT/gpu-check.json

clipserve itself runs from the working tree (the repository root is the working directory).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from clipserve.loadgen.procs import (
    TINY_CONFIG,
    clipserve_process,
    cpu_model,
    gpu_models,
    machine,
)

REPO = Path(__file__).resolve().parent.parent
# Issue 9's targets on one H100: engine FP16 img/s, device busy, served tensors and JPEG img/s.
TARGETS = {
    "engine_fp16": 40_000,
    "device_busy": 0.9,
    "served_tensor": 25_000,
    "served_jpeg": 10_000,
}
OPTIONAL_MODULES = ("onnxruntime", "open_clip", "starlette", "uvicorn", "httptools", "orjson",
                    "python_multipart", "hdrh", "torchvision", "tensorrt")  # fmt: skip


@dataclass
class Plan:
    """Everything a section needs, written to a file for the section's own process."""

    device: str  # "cuda:0" or "cpu"
    quick: bool
    model: str  # open_clip name or a JSON config path
    workers: int
    depths: list[int]
    out_dir: str
    sizes: list[int] = field(default_factory=list)

    @property
    def gpus(self) -> str:
        return "cpu" if self.device == "cpu" else self.device.split(":")[1]

    @property
    def cuda(self) -> bool:
        return self.device != "cpu"


# ---------------------------------------------------------------------------------------------
# Sections: each returns its result; `emit` saves partial results as it goes.

Emit = Callable[[dict[str, Any]], None]


def section_env(plan: Plan, emit: Emit) -> dict[str, Any]:
    import torch

    found = {}
    for name in OPTIONAL_MODULES:
        try:
            module = importlib.import_module(name)
            found[name] = str(getattr(module, "__version__", "yes"))
        except Exception as e:  # a broken optional install is as good as absent
            found[name] = f"absent ({type(e).__name__})"
    out: dict[str, Any] = {"torch": torch.__version__, "modules": found, "machine": machine()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out["gpu"] = {"name": props.name, "capability": f"{props.major}.{props.minor}",
                      "memory_gib": round(props.total_memory / 2**30, 1),
                      "multiprocessors": props.multi_processor_count,
                      "cuda": torch.version.cuda}  # fmt: skip
    with contextlib.suppress(ImportError):
        import onnxruntime

        out["ort_providers"] = onnxruntime.get_available_providers()
    return out


def section_gpu_tests(plan: Plan, emit: Emit) -> dict[str, Any]:
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py")
                   if "mark.gpu" in p.read_text())  # fmt: skip
    if plan.quick and not plan.cuda:
        files = [f for f in files if f.endswith("test_gpu_decode.py")]
    junit = Path(plan.out_dir) / "gpu-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
           f"--junitxml={junit}", *files]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    out: dict[str, Any] = {"files": files, "exit_code": proc.returncode,
                           "tail": proc.stdout[-1500:]}  # fmt: skip
    if junit.exists():
        text = junit.read_text()
        suite = re.search(r"<testsuite [^>]*>", text)
        if suite:
            attrs = dict(re.findall(r'(\w+)="([^"]*)"', suite.group(0)))
            out.update(
                {k: int(attrs.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
            )
        out["failed"] = re.findall(
            r'<testcase [^>]*name="([^"]+)"[^>]*>\s*<(?:failure|error)', text
        )
    if proc.returncode not in (0, 5):  # 5: nothing collected
        raise RuntimeError(f"pytest exited with {proc.returncode}: {out.get('failed')}")
    return out


def executor_variants(plan: Plan) -> list[str]:
    if not plan.cuda:
        return ["torch"]
    variants = ["torch+fp16", "torch+fp16+compile", "cuda-graphs+fp16"]
    with contextlib.suppress(ImportError):
        import onnxruntime

        if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
            variants.append("ort-cuda+fp16")
    return variants


def section_executor(plan: Plan, emit: Emit, variant: str) -> dict[str, Any]:
    from clipserve.loadgen.offline import measure_executor

    backend, *extras = variant.split("+")
    sizes = plan.sizes
    flags = {"model": plan.model, "pretrained": "none", "gpus": plan.gpus, "backend": backend,
             "max_batch_size": str(max(sizes)), "max_queue_size": str(max(sizes)),
             "max_items_per_request": "1"}  # fmt: skip
    if "compile" in extras:
        flags["compile"] = "true"
    if "fp16" in extras:
        flags["precision"] = "fp16"
    result = measure_executor(flags, sizes, min_time_s=0.1 if plan.quick else 0.5, min_runs=3)
    best = max(result["rows"], key=lambda r: r["images_per_s"])
    return {**result, "best_images_per_s": best["images_per_s"], "best_batch": best["batch"]}


def section_decoders(plan: Plan, emit: Emit) -> dict[str, Any]:
    """Pillow's draft path on one thread against the device decoder, in interleaved rounds;
    per core = images per second of the CPU time the process spent."""
    import torch

    from bench.decoders import SPEC, corpus
    from clipserve.inference.gpu_decode import DeviceDecoder
    from clipserve.inference.preprocess import ImageDecoder

    torch.set_num_threads(1)
    images = corpus(16)
    batch = (images * 64)[: 32 if plan.quick else 256]
    host = ImageDecoder(SPEC, 40_000_000)
    dev = DeviceDecoder(host, plan.device)
    sync = torch.cuda.synchronize if plan.cuda else (lambda: None)

    def pillow_round() -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        for data in batch:
            host(data)
        return len(batch) / (time.perf_counter() - wall), len(batch) / (time.process_time() - cpu)

    def device_round() -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        result = dev.decode(batch)
        sync()
        assert len(result.ok) == len(batch), result.errors
        return len(batch) / (time.perf_counter() - wall), len(batch) / (time.process_time() - cpu)

    device_round()  # nvJPEG's handles and buffers, the resize kernels
    rounds: dict[str, list[tuple[float, float]]] = {"pillow": [], "device": []}
    for _ in range(3 if plan.quick else 9):
        rounds["pillow"].append(pillow_round())
        rounds["device"].append(device_round())
    out: dict[str, Any] = {"input": "640x480 q90 JPEG -> 224x224", "batch": len(batch),
                           "device": plan.device}  # fmt: skip
    for name, samples in rounds.items():
        walls, cpus = [s[0] for s in samples], [s[1] for s in samples]
        out[name] = {"images_per_s": round(statistics.median(walls), 1),
                     "images_per_s_min": round(min(walls), 1),
                     "images_per_s_max": round(max(walls), 1),
                     "images_per_cpu_s": round(statistics.median(cpus), 1)}  # fmt: skip
    # How many cores of Pillow the device decoder stands for.
    out["device_in_pillow_cores"] = round(
        out["device"]["images_per_s"] / out["pillow"]["images_per_cpu_s"], 2
    )
    return out


def server_flags(plan: Plan, flags_known: str, depth: int | None, gpu_decode: bool) -> list[str]:
    flags = ["--model", plan.model, "--pretrained", "none", "--gpus", plan.gpus]
    if plan.cuda:
        flags += ["--backend", "cuda-graphs", "--precision", "fp16", "--max-batch-size", "256",
                  "--max-queue-size", "4096"]  # fmt: skip
    else:
        flags += ["--backend", "torch", "--max-batch-size", "16", "--max-queue-size", "256"]
    if plan.workers > 1 and "--workers" in flags_known:
        flags += ["--workers", str(plan.workers)]
    if depth is not None:
        flags += ["--pipeline-depth", str(depth)]
    if gpu_decode:
        flags += ["--decode", "gpu"]
    return flags


def _metrics(url: str) -> dict[str, float]:
    from clipserve.loadgen.server import parse_metrics

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        samples = parse_metrics(r.read().decode())
    busy = sum(
        v for (name, _), v in samples.items() if name == "clipserve_device_busy_seconds_total"
    )
    batch = sum(v for (name, _), v in samples.items()
                if name == "clipserve_batch_duration_seconds_sum")  # fmt: skip
    batches = sum(v for (name, _), v in samples.items()
                  if name == "clipserve_batch_duration_seconds_count")  # fmt: skip
    has_busy = any(name == "clipserve_device_busy_seconds_total" for name, _ in samples)
    return {"busy": busy if has_busy else float("nan"), "batch": batch, "batches": batches,
            "t": time.monotonic()}  # fmt: skip


def section_served(plan: Plan, emit: Emit, payload: str, depth: int | None) -> dict[str, Any]:
    known = subprocess.run([sys.executable, "-m", "clipserve", "--help"], cwd=REPO,
                           capture_output=True, text=True).stdout  # fmt: skip
    out: dict[str, Any] = {"payload": payload, "workers_asked": plan.workers}
    if depth is not None and "--pipeline-depth" not in known:
        out["pipeline_depth"] = "not available (no --pipeline-depth flag)"
        depth = None
    gpu_decode = payload == "jpeg" and plan.cuda and "--decode" in known
    out["decode"] = "gpu" if gpu_decode else "cpu (pool)"
    flags = server_flags(plan, known, depth, gpu_decode)
    out["server_flags"] = flags
    out["workers"] = plan.workers if "--workers" in flags else 1
    quick = plan.quick
    duration, warmup = (4.0, 1.0) if quick else (15.0, 3.0)
    per_request = 8 if quick else (64 if payload == "tensor" else 16)
    kind = "raw-tensor" if payload == "tensor" else "msgpack-images"
    concurrency = 4 if quick else 64
    procs = 1 if quick else 4
    with clipserve_process(flags, startup_s=300) as (_, url):
        report = Path(plan.out_dir) / f"loadgen-{payload}-{depth}.json"
        cmd = [sys.executable, "-m", "clipserve.loadgen", "--url", url, "-q", "--payload", kind,
               "-b", str(per_request), "-c", str(concurrency), "--duration", str(duration),
               "--warmup", str(warmup), "--procs", str(procs), "--json", str(report)]  # fmt: skip
        scrapes: list[dict[str, float]] = []

        def scrape_in_window() -> None:  # inside the measured window, away from its edges
            first = _metrics(url)
            while _metrics(url)["batches"] == first["batches"]:  # the load has begun
                time.sleep(0.2)
            time.sleep(warmup + 0.5)
            scrapes.append(_metrics(url))
            time.sleep(max(0.5, duration - 1.5))
            scrapes.append(_metrics(url))

        scraper = threading.Thread(target=scrape_in_window, daemon=True)
        scraper.start()
        gen = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        scraper.join(timeout=30)
        if gen.returncode != 0 or not report.exists():
            raise RuntimeError(f"clipserve-bench exited {gen.returncode}: {gen.stderr[-800:]}")
    point = json.loads(report.read_text())["results"][0]
    out.update({"pipeline_depth": depth if depth is not None else out.get("pipeline_depth"),
                "images_per_request": per_request, "concurrency": concurrency,
                "images_per_s": point["images_per_s"], "requests_per_s": point["requests_per_s"],
                "latency_ms": point["latency_ms"], "statuses": point["statuses"],
                "server": point["server"]})  # fmt: skip
    if len(scrapes) == 2:
        (a, b), wall = scrapes, scrapes[1]["t"] - scrapes[0]["t"]
        busy = (b["busy"] - a["busy"]) / wall
        # Batch time over wall counts overlapping batches twice: exact for a sequential worker.
        out["batch_time_over_wall"] = round((b["batch"] - a["batch"]) / wall, 3)
        if busy == busy:  # not NaN: the server has the busy counter
            out["device_busy"], out["device_busy_source"] = round(busy, 3), "device_busy_seconds"
        else:
            out["device_busy"] = out["batch_time_over_wall"]
            out["device_busy_source"] = "batch time / wall (no clipserve_device_busy_seconds)"
    else:
        out["device_busy"] = "not available (no scrape inside the window)"
    return out


# ---------------------------------------------------------------------------------------------
# The run: sections in child processes, time limits, one JSON


def sections(plan: Plan) -> list[tuple[str, float]]:
    """(name, time limit in seconds) in running order."""
    # Upper bounds, not estimates: none of this has yet run on a GPU.
    slow = {"torch+fp16+compile": 200.0, "ort-cuda+fp16": 200.0}
    out = [("env", 60.0), ("gpu-tests", 180.0)]
    out += [(f"executor:{v}", slow.get(v, 150.0)) for v in executor_variants(plan)]
    out.append(("decoders", 120.0))
    out += [(f"served:tensor-d{d}", 150.0) for d in plan.depths]
    out.append(("served:jpeg", 150.0))
    return out


def run_section(name: str, plan: Plan, emit: Emit) -> dict[str, Any]:
    kind, _, arg = name.partition(":")
    if kind == "env":
        return section_env(plan, emit)
    if kind == "gpu-tests":
        return section_gpu_tests(plan, emit)
    if kind == "executor":
        return section_executor(plan, emit, arg)
    if kind == "decoders":
        return section_decoders(plan, emit)
    if kind == "served":
        payload, _, depth = arg.partition("-d")
        return section_served(plan, emit, payload, int(depth) if depth else None)
    raise ValueError(f"unknown section {name}")


def child_main(name: str, plan_path: Path, out_path: Path) -> int:
    plan = Plan(**json.loads(plan_path.read_text()))

    def emit(partial: dict[str, Any]) -> None:
        out_path.write_text(json.dumps({"partial": partial}))

    result = run_section(name, plan, emit)
    out_path.write_text(json.dumps({"result": result}, default=str))
    return 0


@contextlib.contextmanager
def _section_process(cmd: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True,  # its servers die with it
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
        try:
            yield proc
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def run_all(plan: Plan, budget_s: float, only: list[str] | None) -> dict[str, Any]:
    start = time.monotonic()
    work = Path(plan.out_dir)
    (work / "plan.json").write_text(json.dumps(asdict(plan)))
    results: dict[str, Any] = {}
    for name, limit in sections(plan):
        if only and not any(name.startswith(o) for o in only):
            continue
        left = budget_s - (time.monotonic() - start)
        limit = min(limit, left - 5)
        if limit < 20:
            results[name] = {"status": "skipped", "error": "budget spent"}
            continue
        print(f"[{time.monotonic() - start:6.0f} s] {name} (limit {limit:.0f} s)", flush=True)
        out_path = work / f"{name.replace(':', '_')}.json"
        log = work / f"{name.replace(':', '_')}.log"
        cmd = [sys.executable, "-m", "bench.gpu_check", "--section", name,
               "--plan", str(work / "plan.json"), "--section-out", str(out_path)]  # fmt: skip
        t0 = time.monotonic()
        with _section_process(cmd, log) as proc:
            try:
                code: int | None = proc.wait(limit)
            except subprocess.TimeoutExpired:
                code = None
        entry: dict[str, Any] = {"seconds": round(time.monotonic() - t0, 1),
                                 "limit_s": round(limit)}  # fmt: skip
        saved = json.loads(out_path.read_text()) if out_path.exists() else {}
        if code == 0 and "result" in saved:
            entry.update(status="ok", result=saved["result"])
        else:
            entry["status"] = "timed_out" if code is None else "failed"
            entry["error"] = log.read_text(errors="replace")[-2000:]
            if "partial" in saved:
                entry["partial"] = saved["partial"]
        print(f"         {entry['status']} in {entry['seconds']} s", flush=True)
        results[name] = entry
    return results


def summary(results: dict[str, Any]) -> dict[str, Any]:
    def ok(name: str) -> dict[str, Any]:
        entry = results.get(name, {})
        return entry.get("result", {}) if entry.get("status") == "ok" else {}

    engine = {n.split(":", 1)[1]: ok(n).get("best_images_per_s") for n in results
              if n.startswith("executor:")}  # fmt: skip
    tensor = {n: ok(n) for n in results if n.startswith("served:tensor")}
    busy = [r["device_busy"] for r in tensor.values() if isinstance(r.get("device_busy"), float)]
    # The pipelined worker's figure; a sequential one (or a CPU run) says what it can.
    out = {
        "engine_best_images_per_s": engine,
        "device_busy": max(busy) if busy else "not available",
        "served_tensor_images_per_s": {n: r.get("images_per_s") for n, r in tensor.items()},
        "served_jpeg_images_per_s": ok("served:jpeg").get("images_per_s"),
        "device_decoder_in_pillow_cores": ok("decoders").get("device_in_pillow_cores"),
        "gpu_tests": {
            k: ok("gpu-tests").get(k) for k in ("tests", "failures", "errors", "skipped")
        },
    }
    out["targets"] = TARGETS
    return out


def slug(text: str) -> str:
    text = re.sub(r"\((R|TM)\)|\bNVIDIA\b|\bCPU\b|@.*$", " ", text)
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu_check", description=__doc__.split("\n")[0]
    )
    p.add_argument("--allow-cpu", action="store_true", help="run without a GPU (checks the tool)")
    p.add_argument("--quick", action="store_true", help="tiny model, seconds per section")
    p.add_argument("--model", help="open_clip model (default ViT-B-32; --quick: the tiny one)")
    p.add_argument("--workers", type=int, default=1, help="front-end processes for served rates")
    p.add_argument("--pipeline-depths", default="2,3", help="served tensor runs, one per depth")
    p.add_argument("--budget-s", type=float, default=1200.0, help="the whole run's time budget")
    p.add_argument("--only", help="comma-separated section name prefixes (env,executor,...)")
    p.add_argument("--out", type=Path, help="the JSON (default bench/results/gpu-check-...)")
    p.add_argument(
        "--merge",
        type=Path,
        help="an earlier run's JSON: its sections are kept "
        "unless this run repeats them (one check split over several calls)",
    )
    p.add_argument("--section", help=argparse.SUPPRESS)
    p.add_argument("--plan", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--section-out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.section:
        return child_main(args.section, args.plan, args.section_out)

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print("gpu_check: no CUDA device (pass --allow-cpu to check the tool itself)")
        return 2
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    model = args.model
    if model is None and (args.quick or not cuda):
        model = str(work / "tiny-clip.json")
        Path(model).write_text(json.dumps(TINY_CONFIG))
    sizes = [1, 4, 16] if args.quick else [2**i for i in range(11)]
    plan = Plan(device="cuda:0" if cuda else "cpu", quick=args.quick, model=model or "ViT-B-32",
                workers=args.workers, depths=[int(d) for d in args.pipeline_depths.split(",")],
                out_dir=str(work), sizes=sizes)  # fmt: skip
    started = time.monotonic()
    results = run_all(plan, args.budget_s, args.only.split(",") if args.only else None)
    if args.merge:
        results = {**json.loads(args.merge.read_text())["sections"], **results}
    gpu = (gpu_models() or [None])[0]
    doc = {
        "benchmark": "gpu-check",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "gpu": gpu,
        "mode": "cuda" if cuda else "cpu",
        "quick": args.quick,
        "model": f"{plan.model} (random weights)",
        "workers": args.workers,
        "budget_s": args.budget_s,
        "wall_s": round(time.monotonic() - started, 1),
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, {platform.system()}",
        "summary": summary(results),
        "sections": results,
    }
    name = (
        f"gpu-check-{slug(gpu) if gpu else 'cpu-' + slug(cpu_model())}-{time.strftime('%Y-%m-%d')}"
    )
    out = args.out or REPO / "bench" / "results" / f"{name}{'-quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(json.dumps(doc["summary"], indent=2, default=str))
    print(f"wrote {out}")
    failed = [n for n, r in results.items() if r.get("status") not in ("ok", "skipped")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
