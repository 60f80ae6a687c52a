"""`clipserve doctor` on this (GPU-less) host: the real libraries probed, the server's own device
and backend decision, and an exit status that says whether these flags can serve."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clipserve.inference import doctor
from clipserve.inference.doctor import captured_stderr, provider_reason
from tests.helpers import run_clipserve


def _findings(stdout: str) -> dict[str, dict[str, str]]:
    doc = json.loads(stdout)
    return {f["name"]: f for f in doc["findings"]}


def test_doctor_reports_the_host_and_what_would_serve() -> None:
    run = run_clipserve("doctor", "--json", "--backend", "torch", "--gpus", "cpu")
    assert run.returncode == 0, run.stderr[-2000:]
    found = _findings(run.stdout)
    assert json.loads(run.stdout)["ok"] is True
    assert found["cpu"]["status"] == "ok" and "would serve with torch" in found["cpu"]["detail"]
    for name in ("python", "cores", "/dev/shm", "open files", "torch", "onnxruntime", "nvJPEG"):
        assert name in found, name
    # This host has no GPU: ONNX Runtime's own reason, not a guess.
    cuda = found["CUDAExecutionProvider"]["detail"]
    assert "cannot load" in cuda or "not in this onnxruntime build" in cuda
    text = run_clipserve("doctor", "--backend", "torch", "--gpus", "cpu")
    assert text.returncode == 0 and "can serve with these flags" in text.stdout


def test_doctor_fails_for_flags_that_cannot_serve() -> None:
    run = run_clipserve("doctor", "--json", "--backend", "ort-cuda", "--gpus", "cpu")
    assert run.returncode == 1
    found = _findings(run.stdout)
    assert found["cpu"]["status"] == "fail" and "needs a CUDA device" in found["cpu"]["detail"]
    run = run_clipserve("doctor", "--json", "--gpus", "0")
    assert run.returncode == 1
    assert "no CUDA device 0" in _findings(run.stdout)["--gpus 0"]["detail"]


def test_provider_probe_and_stderr_capture() -> None:
    assert provider_reason("CPUExecutionProvider") is None
    assert provider_reason("NoSuchExecutionProvider") == "not in this onnxruntime build"
    with captured_stderr() as err:
        os.write(2, b"written by a C library\n")
    assert err.getvalue() == "written by a C library\n"


def test_doctor_explains_the_accept_queues_of_front_ends() -> None:
    shared = _findings(run_clipserve("doctor", "--json", "--gpus", "cpu", "--workers", "2").stdout)
    assert "--reuse-port spreads" in shared["accept queues"]["detail"]
    run = run_clipserve("doctor", "--json", "--gpus", "cpu", "--workers", "2", "--reuse-port")
    assert "one per front end" in _findings(run.stdout)["accept queues"]["detail"]
    one = _findings(run_clipserve("doctor", "--json", "--gpus", "cpu", "--reuse-port").stdout)
    assert "accept queues" not in one  # one process: no front ends to spread over


@pytest.mark.parametrize(
    ("sysctl", "status", "says"),
    [
        ("1", "ok", "a dead one's queue goes to the others"),
        ("0", "warn", "are reset (set it to 1)"),
        (None, "info", "Linux 5.14+"),
    ],
)
def test_accept_queues_read_tcp_migrate_req(
    sysctl: str | None, status: str, says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tcp_migrate_req"
    if sysctl is not None:
        path.write_text(sysctl + "\n")
    monkeypatch.setattr(doctor, "MIGRATE_REQ", path)
    found = doctor._accept_queues(reuse_port=True)
    assert found.status == status and says in found.detail


def test_a_reader_that_leaves_early_gets_no_traceback() -> None:
    """`clipserve doctor --json | head`: its output meets a closed pipe; the exit is quiet."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "clipserve", "doctor", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # Block-buffered, as in a shell: the report meets the closed pipe as it is flushed.
        env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
        | {"HF_HUB_OFFLINE": "1"},
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # gone before a byte is read
    with proc.stderr:
        err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
