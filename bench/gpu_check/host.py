"""The env and gpu-tests sections: what the host has (versions, the GPU, which optional packages
import) and whether the GPU tests pass on it."""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import REPO
from bench.gpu_check.plan import Emit, Plan
from clipserve.loadgen.procs import machine

OPTIONAL_MODULES = (
    "onnxruntime",
    "open_clip",
    "starlette",
    "uvicorn",
    "httptools",
    "orjson",
    "python_multipart",
    "hdrh",
    "torchvision",
    "tensorrt",
)


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
        out["gpu"] = {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count,
            "cuda": torch.version.cuda,
        }
    with contextlib.suppress(ImportError):
        import onnxruntime

        out["ort_providers"] = onnxruntime.get_available_providers()
    return out


def gpu_test_files(plan: Plan) -> list[str]:
    """The test files that hold GPU tests (without a GPU, --quick: the device decoder's only)."""
    tests = sorted((REPO / "tests").rglob("test_*.py"))
    files = [str(p.relative_to(REPO)) for p in tests if "mark.gpu" in p.read_text()]
    if plan.quick and not plan.cuda:
        files = [f for f in files if f.endswith("test_gpu_decode.py")]
    return files


def section_gpu_tests(plan: Plan, emit: Emit) -> dict[str, Any]:
    files = gpu_test_files(plan)
    junit = Path(plan.out_dir) / "gpu-tests.xml"
    pytest = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]
    proc = subprocess.run(
        [*pytest, f"--junitxml={junit}", *files], cwd=REPO, capture_output=True, text=True
    )
    out: dict[str, Any] = {"files": files, "exit_code": proc.returncode}
    out["tail"] = proc.stdout[-1500:]
    # The whole output beside the JSON: a failure's report is longer than any tail.
    (Path(plan.out_dir) / "gpu-tests-pytest.log").write_text(proc.stdout + proc.stderr)
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
    if plan.cuda:  # the decode and pipelined paths again, under PyTorch's stream sanitizer
        out["sanitizer"] = sanitized_tests(plan)
    emit(out)  # kept with the section's failure: which tests failed, and the sanitizer's run
    if proc.returncode not in (0, 5):  # 5: nothing collected
        raise RuntimeError(f"pytest exited with {proc.returncode}: {out.get('failed')}")
    if out.get("sanitizer", {}).get("exit_code", 0) not in (0, 5):
        raise RuntimeError(f"under TORCH_CUDA_SANITIZER=1: {out['sanitizer']['tail'][-600:]}")
    return out


SANITIZED = (
    "tests/inference/test_gpu_decode.py",
    "tests/inference/test_gpu_decode_safety.py",
    "tests/backends/test_executors.py",
    "tests/batching/test_worker.py",  # launch/wait: the staging slots and the copy stream
    "tests/batching/test_worker_pixels.py",
)


def sanitized_tests(plan: Plan) -> dict[str, Any]:
    """The decode and executor (launch/wait) GPU tests with TORCH_CUDA_SANITIZER=1: a kernel
    reading memory another stream writes without synchronisation fails its test."""
    files = [f for f in SANITIZED if (REPO / f).exists()]
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *files]
    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1"}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    (Path(plan.out_dir) / "sanitizer-pytest.log").write_text(proc.stdout + proc.stderr)
    return {"files": files, "exit_code": proc.returncode, "tail": proc.stdout[-1500:]}
