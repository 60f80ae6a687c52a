"""The startup self-check: canaries through the served path against a CPU FP32 reference. Real
backends pass (torch, ORT on the CPU); a backend that computes wrong numbers (the fake's
`perturb`) fails, and under --self-check strict the server stays unready, in one process and
under --workers N. The canaries go the way the device worker feeds the executor: a fault only
in launch/wait (or in taking GPU-decoded crops) is found where the worker would serve through
it. The text tower's check: test_self_check_text.py."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

import clipserve.backends.torch_eager as torch_eager
from clipserve.inference.runtime import Runtime, build_runtime
from clipserve.inference.self_check import FLOORS, canary_images, run_self_check
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
        assert check["texts"] == 4 and check["text_min_cosine"] >= check["text_floor"]
        assert check["text_floor"] == FLOORS["fp32"]  # the text tower runs FP32 on the CPU
    finally:
        runtime.close()


def _unchecked(tiny_config: Path, tiny_checkpoint: Path, **flags: object) -> Runtime:
    """A runtime built without its check: the test breaks something, then runs it."""
    return build_runtime(make_config(tiny_config, tiny_checkpoint, self_check="off", **flags))


@pytest.mark.parametrize("depth", [2, 1])
def test_a_fault_only_in_launched_batches_is_found_where_the_worker_launches(
    tiny_config: Path, tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, depth: int
) -> None:
    """The fake with stream=1 is asynchronous on the CPU: with its launched rows out of order
    (a staging mix-up) and `run` right, the check fails at --pipeline-depth 2 (the worker
    launches) and passes at 1 (the worker runs). Two batches of two: one waited for while the
    next is in flight."""
    flags = {"backend": "fake", "backend_option": ["stream=1"], "max_batch_size": 2}
    runtime = _unchecked(tiny_config, tiny_checkpoint, pipeline_depth=depth, **flags)
    try:
        executor = runtime.executors[0]
        launched = executor._launched  # type: ignore[attr-defined]
        monkeypatch.setattr(executor, "_launched", lambda b, m: launched(b, m)[::-1].copy())
        check = run_self_check(runtime, "strict")
        assert check["status"] == ("failed" if depth > 1 else "passed"), check
        assert check["text_min_cosine"] >= FLOORS["fp32"]  # the text tower is right
    finally:
        runtime.close()


def test_torch_launch_and_wait_are_what_the_check_runs(
    tiny_config: Path, tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's asynchronous path (staging slots, the on-device L2 normalisation), as CUDA
    serves through it, run here on the CPU's synchronous stream: right, it passes at the FP32
    floor; rows zeroed, or left unnormalised (the right direction, not unit length), fail."""
    runtime = _unchecked(tiny_config, tiny_checkpoint, max_batch_size=4)
    try:
        monkeypatch.setattr(runtime.executors[0], "asynchronous", True)  # as on CUDA
        check = run_self_check(runtime, "strict")
        assert check["status"] == "passed" and check["min_cosine"] >= FLOORS["fp32"], check
        for fault in (lambda x, mask: torch.zeros_like(x.float()), lambda x, mask: x.float()):
            monkeypatch.setattr(torch_eager, "l2_normalise_device", fault)
            check = run_self_check(runtime, "strict")
            assert check["status"] == "failed" and check["min_cosine"] < 0.5, check
    finally:
        runtime.close()


def test_gpu_decoded_crops_reach_the_executor_as_the_worker_hands_them(
    tiny_config: Path, tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--decode gpu (on the CPU here): the worker hands the crops over on the executor's
    device, through `run_pixels` (synchronous) or `launch_pixels` (pipelined); a fault in
    either alone fails the check."""
    runtime = _unchecked(tiny_config, tiny_checkpoint, decode="gpu", max_batch_size=4)
    try:
        executor = runtime.executors[0]
        run_pixels = executor.run_pixels  # type: ignore[attr-defined]
        monkeypatch.setattr(executor, "run_pixels", lambda px: run_pixels(px)[::-1].copy())
        assert run_self_check(runtime, "strict")["status"] == "failed"
        monkeypatch.undo()
        launch_pixels = executor.launch_pixels  # type: ignore[attr-defined]
        launches: list[int] = []

        def counted(pixels: torch.Tensor, normalize: np.ndarray) -> object:
            launches.append(len(pixels))
            return launch_pixels(pixels, normalize)

        monkeypatch.setattr(executor, "asynchronous", True)  # as on CUDA
        monkeypatch.setattr(executor, "launch_pixels", counted)
        assert run_self_check(runtime, "strict")["status"] == "passed" and launches == [4]
        monkeypatch.setattr(torch_eager, "l2_normalise_device", lambda x, m: x.float() * 0)
        assert run_self_check(runtime, "strict")["status"] == "failed"
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
    assert check["texts"] == 4 and check["text_min_cosine"] >= FLOORS["fp32"]  # not perturbed
    metrics = httpx.get(server.url + "/metrics").text
    image = f'clipserve_self_check_min_cosine{{tower="image"}} {check["min_cosine"]}'
    text = f'clipserve_self_check_min_cosine{{tower="text"}} {check["text_min_cosine"]}'
    floor = f'clipserve_self_check_floor{{tower="image"}} {check["floor"]}'
    assert image in metrics and text in metrics and floor in metrics, metrics
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
