"""Servers the benchmarks start themselves: `clipserve` subprocesses on free loopback ports."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO

# The tiny open_clip architecture the tests use: real code paths, milliseconds per batch.
TINY_CONFIG = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 224, "layers": 2, "width": 64, "head_width": 32, "patch_size": 32},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tiny_model(directory: Path) -> Path:
    path = directory / "tiny-clip.json"
    path.write_text(json.dumps(TINY_CONFIG))
    return path


def ready(url: str, path: str = "/readyz") -> bool:
    """Whether `url`'s readiness `path` answers 200 now."""
    try:
        with urllib.request.urlopen(url + path, timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def wait_ready(
    proc: subprocess.Popen[bytes], url: str, startup_s: float, what: str, path: str = "/readyz"
) -> None:
    """Until `url`'s readiness `path` answers 200; RuntimeError if `proc` exits or time runs
    out."""
    deadline = time.monotonic() + startup_s
    while not ready(url, path):
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready after {startup_s:g} s")
        time.sleep(0.1)


def server_command(flags: Sequence[str], port: int, tree: Path | None = None) -> list[str]:
    """`python -m clipserve FLAGS` on `port`, with what a benchmark's server needs unless the
    flags say otherwise."""
    cmd = [sys.executable, "-m", "clipserve", *flags, "--host", "127.0.0.1", "--port", str(port)]
    if "--log-level" not in flags:
        cmd += ["--log-level", "warning"]
    if "--cache-mb" not in flags and knows(tree, "cache_mb"):
        # Benchmarks send one payload over and over: with the embedding cache on, they would
        # measure its hits, not the path to the device. bench/cache.py turns it on itself.
        cmd += ["--cache-mb", "0"]
    grpc_chosen = "--grpc-port" in flags or "CLIPSERVE_GRPC_PORT" in os.environ
    if not grpc_chosen and knows(tree, "grpc_port"):
        # gRPC stays on, as served, on a port of its own: not Triton's 8001, which a test
        # server or another benchmark's may hold (the tests' environment turns it off).
        cmd += ["--grpc-port", str(free_port())]
    return cmd


@contextlib.contextmanager
def clipserve_process(
    flags: Sequence[str],
    *,
    startup_s: float = 600,
    cpus: set[int] | None = None,
    cwd: Path | None = None,
    stdout: IO[str] | None = None,
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`python -m clipserve FLAGS` on a free port until the block ends; yields the process and
    its URL once /readyz answers. With `cwd`, the server is imported from that source tree
    (`-m` puts the cwd first); `stdout` takes its output (stderr too)."""
    port = free_port()
    cmd = server_command(flags, port, cwd)
    stderr = None if stdout is None else subprocess.STDOUT
    proc = subprocess.Popen(cmd, preexec_fn=pin(cpus), cwd=cwd, stdout=stdout, stderr=stderr)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, startup_s, f"server ({' '.join(flags)})")
        yield proc, url
    finally:
        stop(proc)


def knows(tree: Path | None, setting: str) -> bool:
    """Whether the server imported from `tree` (None: this one) has the setting (a flag): a
    benchmark may run a checkout from before the flag."""
    if tree is None:
        return True
    sources = [tree / "clipserve" / "config.py", tree / "clipserve" / "config" / "schema.py"]
    return any(s.is_file() and setting in s.read_text() for s in sources)


@contextlib.contextmanager
def clipserve_server(
    flags: Sequence[str],
    *,
    startup_s: float = 600,
    cpus: set[int] | None = None,
    cwd: Path | None = None,
) -> Iterator[str]:
    """`clipserve_process` for callers that need only the URL."""
    with clipserve_process(flags, startup_s=startup_s, cpus=cpus, cwd=cwd) as (_, url):
        yield url


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def pin(cpus: set[int] | None) -> Callable[[], None] | None:
    """A preexec_fn pinning a child process to `cpus` (None: no pinning)."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return None

    def pin() -> None:
        os.sched_setaffinity(0, cpus)

    return pin


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        match = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
        if match:
            return " ".join(match.group(1).split())
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_models() -> list[str]:
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def machine() -> dict[str, object]:
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "gpus": gpu_models(),
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
    }


def machine_slug() -> str:
    """A directory-name fragment naming the CPU model and the GPU model, if any."""
    names = [cpu_model(), *gpu_models()[:1]]
    words = []
    for name in names:
        name = re.sub(r"\((R|TM|tm|r)\)|\bCPU\b|\bProcessor\b|@.*$|\bNVIDIA\b", " ", name)
        words.append(re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower())
    words.insert(1, f"{os.cpu_count()}c")
    return "-".join(w for w in words if w)
