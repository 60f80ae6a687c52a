"""The run: each section in its own process (its own session: its servers die with it) with its
own time limit, within the whole run's budget; what each measured, or why it did not."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.common import REPO
from bench.gpu_check.decoders import section_decoders
from bench.gpu_check.engine import executor_variants, section_executor
from bench.gpu_check.host import section_env, section_gpu_tests
from bench.gpu_check.pipelined import pipelined_variants, section_pipelined
from bench.gpu_check.plan import Emit, Plan
from bench.gpu_check.served import section_served


def sections(plan: Plan) -> list[tuple[str, float]]:
    """(name, time limit in seconds) in running order."""
    # Upper bounds, not estimates: none of this has yet run on a GPU.
    # ort-trt builds its engine on first run (minutes for ViT-B-32's profile).
    slow = {"torch+fp16+compile": 200.0, "ort-cuda+fp16": 200.0, "ort-trt+fp16": 420.0}
    # gpu-tests runs the decode tests a second time under TORCH_CUDA_SANITIZER=1 on CUDA.
    out = [("env", 60.0), ("gpu-tests", 300.0 if plan.cuda else 180.0)]
    out += [(f"executor:{v}", slow.get(v, 150.0)) for v in executor_variants(plan)]
    # run() against launch/wait at depths 1-3 and the worker: 3 sizes x 7 modes x 4 windows.
    out += [(f"pipelined:{v}", 150.0) for v in pipelined_variants(plan)]
    out.append(("decoders", 180.0))
    out += [(f"served:tensor-d{d}", 150.0) for d in plan.depths]
    out.append(("served:single", 150.0))
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
    if kind == "pipelined":
        return section_pipelined(plan, emit, arg)
    if kind == "decoders":
        return section_decoders(plan, emit)
    if kind == "served":
        payload, _, depth = arg.partition("-d")
        return section_served(plan, emit, payload, int(depth) if depth else None)
    raise ValueError(f"unknown section {name}")


def child_main(name: str, plan_path: Path, out_path: Path) -> int:
    """A section's own process: its result (or what it saved before failing) into `out_path`."""
    plan = Plan(**json.loads(plan_path.read_text()))

    def emit(partial: dict[str, Any]) -> None:
        out_path.write_text(json.dumps({"partial": partial}))

    result = run_section(name, plan, emit)
    out_path.write_text(json.dumps({"result": result}, default=str))
    return 0


@contextlib.contextmanager
def _section_process(cmd: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("wb") as sink:
        # A session of its own: the servers it starts die with it.
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
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


def chosen(name: str, only: list[str] | None, skip: list[str]) -> bool:
    """Whether --only (prefixes; none: all) and --skip (prefixes) leave the section in."""
    wanted = not only or any(name.startswith(o) for o in only)
    return wanted and not any(name.startswith(s) for s in skip)


def default_budget(plan: Plan, only: list[str] | None, skip: list[str]) -> float:
    """The sum of the limits of the sections that will run: none is skipped for want of time
    unless --budget-s asks for less."""
    return sum(limit for name, limit in sections(plan) if chosen(name, only, skip))


def run_all(plan: Plan, budget_s: float, only: list[str] | None, skip: list[str]) -> dict[str, Any]:
    start = time.monotonic()
    work = Path(plan.out_dir)
    (work / "plan.json").write_text(json.dumps(asdict(plan)))
    results: dict[str, Any] = {}
    for name, limit in sections(plan):
        if not chosen(name, only, skip):
            continue
        left = budget_s - (time.monotonic() - start)
        limit = min(limit, left - 5)
        if limit < 20:
            results[name] = {"status": "skipped", "error": "budget spent"}
            continue
        print(f"[{time.monotonic() - start:6.0f} s] {name} (limit {limit:.0f} s)", flush=True)
        results[name] = run_one(name, limit, work)
        print(f"         {results[name]['status']} in {results[name]['seconds']} s", flush=True)
    return results


def run_one(name: str, limit: float, work: Path) -> dict[str, Any]:
    """One section in its own process, stopped after `limit` seconds: its result, or its
    status, its log's tail and whatever it saved so far."""
    out_path = work / f"{name.replace(':', '_')}.json"
    log = work / f"{name.replace(':', '_')}.log"
    cmd = [sys.executable, "-m", "bench.gpu_check", "--section", name]
    cmd += ["--plan", str(work / "plan.json"), "--section-out", str(out_path)]
    t0 = time.monotonic()
    with _section_process(cmd, log) as proc:
        try:
            code: int | None = proc.wait(limit)
        except subprocess.TimeoutExpired:
            code = None
    entry: dict[str, Any] = {"seconds": round(time.monotonic() - t0, 1), "limit_s": round(limit)}
    saved = json.loads(out_path.read_text()) if out_path.exists() else {}
    if code == 0 and "result" in saved:
        entry.update(status="ok", result=saved["result"])
    else:
        entry["status"] = "timed_out" if code is None else "failed"
        entry["error"] = log.read_text(errors="replace")[-2000:]
        if "partial" in saved:
            entry["partial"] = saved["partial"]
    return entry
