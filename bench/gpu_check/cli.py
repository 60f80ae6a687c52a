"""`python -m bench.gpu_check`: the flags, the plan, the run and its one JSON, with a summary
against issue 9's targets."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import bench.gpu_check
from bench.common import REPO, utc_now
from bench.gpu_check.plan import Plan
from bench.gpu_check.run import child_main, default_budget, run_all
from clipserve.loadgen.procs import TINY_CONFIG, cpu_model, gpu_models

# Issue 9's targets on one H100: engine FP16 img/s, device busy, served tensors and JPEG img/s.
TARGETS = {
    "engine_fp16": 40_000,
    "device_busy": 0.9,
    "served_tensor": 25_000,
    "served_jpeg": 10_000,
}


def parser() -> argparse.ArgumentParser:
    assert bench.gpu_check.__doc__
    description = bench.gpu_check.__doc__.split("\n")[0]
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=description)
    p.add_argument("--allow-cpu", action="store_true", help="run without a GPU (checks the tool)")
    p.add_argument("--quick", action="store_true", help="tiny model, seconds per section")
    p.add_argument("--model", help="open_clip model (default ViT-B-32; --quick: the tiny one)")
    p.add_argument("--workers", type=int, default=1, help="front-end processes for served rates")
    p.add_argument(
        "--reuse-port", action="store_true", help="with --workers N: the server's --reuse-port"
    )
    p.add_argument("--pipeline-depths", default="2,3", help="served tensor runs, one per depth")
    p.add_argument(
        "--budget-s", type=float, help="the whole run's time budget (default: its sections' sum)"
    )
    p.add_argument("--only", help="comma-separated section name prefixes (env,executor,...)")
    p.add_argument("--skip", help="comma-separated section name prefixes to leave out")
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
    return p


def summary(results: dict[str, Any]) -> dict[str, Any]:
    def ok(name: str) -> dict[str, Any]:
        entry = results.get(name, {})
        return entry.get("result", {}) if entry.get("status") == "ok" else {}

    executors = [n for n in results if n.startswith("executor:")]
    engine = {n.split(":", 1)[1]: ok(n).get("best_images_per_s") for n in executors}
    tensor = {n: ok(n) for n in results if n.startswith("served:tensor")}
    busy = [r["device_busy"] for r in tensor.values() if isinstance(r.get("device_busy"), float)]
    # The pipelined worker's figure; a sequential one (or a CPU run) says what it can.
    return {
        "engine_best_images_per_s": engine,
        "device_busy": max(busy) if busy else "not available",
        "served_tensor_images_per_s": {n: r.get("images_per_s") for n, r in tensor.items()},
        "served_single_requests_per_s": ok("served:single").get("requests_per_s"),
        "served_jpeg_images_per_s": ok("served:jpeg").get("images_per_s"),
        "pipelined_vs_run": {
            n.split(":", 1)[1]: pipelined_summary(ok(n))
            for n in results
            if n.startswith("pipelined:")
        },
        "device_decoder_in_pillow_cores": ok("decoders").get("device_in_pillow_cores"),
        "gpu_tests": {
            k: ok("gpu-tests").get(k) for k in ("tests", "failures", "errors", "skipped")
        },
        "targets": TARGETS,
    }


def pipelined_summary(result: dict[str, Any]) -> dict[str, Any]:
    """Per batch size, the best launch/wait and worker rate over run()'s (medians of rounds'
    ratios, over depths), and the worst cosine of their rows against run()'s."""
    best: dict[str, dict[str, float]] = {}
    for row in result.get("rows", []):
        if row["mode"] != "run":
            per_size = best.setdefault(str(row["batch"]), {})
            per_size[row["mode"]] = max(per_size.get(row["mode"], 0.0), row["vs_run"]["median"])
    check = result.get("check", {})
    cosines = [*check.get("min_cosine", {}).values(), *check.get("worker_min_cosine", {}).values()]
    return {"vs_run": best, "min_cosine": min(cosines) if cosines else None}


def slug(text: str) -> str:
    text = re.sub(r"\((R|TM)\)|\bNVIDIA\b|\bCPU\b|@.*$", " ", text)
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "unknown"


def plan_of(args: argparse.Namespace, cuda: bool) -> Plan:
    """Where and what to measure; the tiny model (written to the run's directory) with --quick
    or without a GPU, unless --model names one."""
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    model = args.model
    if model is None and (args.quick or not cuda):
        model = str(work / "tiny-clip.json")
        Path(model).write_text(json.dumps(TINY_CONFIG))
    return Plan(
        device="cuda:0" if cuda else "cpu",
        quick=args.quick,
        model=model or "ViT-B-32",
        workers=args.workers,
        reuse_port=args.reuse_port,
        depths=[int(d) for d in args.pipeline_depths.split(",")],
        out_dir=str(work),
        sizes=[1, 4, 16] if args.quick else [2**i for i in range(11)],
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.section:
        return child_main(args.section, args.plan, args.section_out)

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print("gpu_check: no CUDA device (pass --allow-cpu to check the tool itself)")
        return 2
    plan = plan_of(args, cuda)
    started = time.monotonic()
    only = args.only.split(",") if args.only else None
    skip = args.skip.split(",") if args.skip else []
    budget_s = args.budget_s if args.budget_s is not None else default_budget(plan, only, skip)
    results = run_all(plan, budget_s, only, skip)
    if args.merge:
        results = {**json.loads(args.merge.read_text())["sections"], **results}
    gpus = gpu_models()
    gpu = gpus[0] if gpus else None
    doc = {
        "benchmark": "gpu-check",
        "time": utc_now(),
        "gpu": gpu,
        "mode": "cuda" if cuda else "cpu",
        "quick": args.quick,
        "model": f"{plan.model} (random weights)",
        "workers": args.workers,
        "reuse_port": args.reuse_port and args.workers > 1,  # served sections' flags say more
        "budget_s": budget_s,
        "wall_s": round(time.monotonic() - started, 1),
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, {platform.system()}",
        "summary": summary(results),
        "sections": results,
    }
    name = f"gpu-check-{slug(gpu) if gpu else 'cpu-' + slug(cpu_model())}"
    name += f"-{time.strftime('%Y-%m-%d')}{'-quick' if args.quick else ''}"
    out = args.out or REPO / "bench" / "results" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(json.dumps(doc["summary"], indent=2, default=str))
    print(f"wrote {out}")
    failed = [n for n, r in results.items() if r.get("status") not in ("ok", "skipped")]
    return 1 if failed else 0
