"""The startup self-check: canaries through the served path against a CPU FP32 reference. Real
backends pass (torch, ORT on the CPU); a backend that computes wrong numbers (the fake's
`perturb`) fails, and under --self-check strict the server stays unready, in one process and
under --workers N."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from clipserve.inference.runtime import build_runtime
from clipserve.inference.self_check import FLOORS, canary_images
from clipserve.loadgen.procs import free_port
from tests.engine.test_workers_served import stop_tree
from tests.helpers import Serve, make_config, until


def test_the_canaries_are_the_same_bytes_every_time() -> None:
    assert canary_images() == canary_images()
    assert len(canary_images()) == 4


@pytest.mark.parametrize("backend", ["torch", "ort-cpu"])
def test_real_backends_pass(tiny_config: Path, tiny_checkpoint: Path, backend: str) -> None:
    runtime = build_runtime(make_config(tiny_config, tiny_checkpoint, backend=backend))
    try:
        check = runtime.self_check
        assert check is not None and check["status"] == "passed", check
        assert check["mode"] == "warn"  # auto on the CPU
        assert check["images"] == 4 and check["reference"] == "torch-cpu-fp32"
        assert check["min_cosine"] >= FLOORS["fp32"]
    finally:
        runtime.close()


def test_wrong_numbers_fail_and_strict_keeps_the_server_unready(serve: Serve) -> None:
    server = serve(backend="fake", backend_option=["perturb=0.1"], self_check="strict")
    ready = httpx.get(server.url + "/readyz")
    assert ready.status_code == 503
    assert httpx.get(server.url + "/v2/health/ready").status_code == 503
    assert httpx.get(server.url + "/healthz").status_code == 200  # alive: no restart loop
    check = httpx.get(server.url + "/info").json()["self_check"]
    assert check["status"] == "failed" and check["mode"] == "strict"
    assert 0.9 < check["min_cosine"] < FLOORS["fp32"]
    metrics = httpx.get(server.url + "/metrics").text
    assert f"clipserve_self_check_min_cosine {check['min_cosine']}" in metrics
    # warn serves anyway; off does not check.
    warned = serve(backend="fake", backend_option=["perturb=0.1"], self_check="warn")
    assert httpx.get(warned.url + "/readyz").status_code == 200
    assert httpx.get(warned.url + "/info").json()["self_check"]["status"] == "failed"
    off = serve(backend="fake", backend_option=["perturb=0.1"], self_check="off")
    assert httpx.get(off.url + "/info").json()["self_check"]["status"] == "skipped"


@pytest.mark.slow  # a multi-process or long variant: CI runs it (make test-slow)
def test_strict_failure_reaches_every_front_end(tiny_config: Path, tmp_path: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "clipserve", "--workers", "2", "--backend", "fake"]
    cmd += ["--backend-option", "perturb=0.1", "--self-check", "strict", "--model"]
    cmd += [str(tiny_config), "--pretrained", "none", "--gpus", "cpu", "--port", str(port)]
    log = tmp_path / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:

        def alive() -> bool:
            try:
                return httpx.get(url + "/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        until(alive, 120, "the front ends serving")
        for _ in range(8):  # both front ends, most likely
            assert httpx.get(url + "/readyz", timeout=5).status_code == 503
        assert httpx.get(url + "/info", timeout=5).json()["self_check"]["status"] == "failed"
        time.sleep(0.2)
        assert "below the floor" in log.read_text() and "not ready" in log.read_text()
    finally:
        stop_tree(proc)
