"""`python -m bench.gpu_check`: its CPU mode end to end (slow), how it records sections that
fail or do not fit the budget, and the pipelined section (launch/wait and the worker against
run()), in-process over the fake's simulated stream and as a section over the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bench.gpu_check.pipelined import (
    DEPTHS,
    MIN_BATCHES,
    MIN_COSINE,
    check_launch_wait,
    min_cosine,
    time_launch_wait,
    time_worker,
)
from bench.gpu_check.plan import Plan
from bench.gpu_check.run import chosen, default_budget, sections
from bench.gpu_check.served import Load, server_flags
from clipserve.backends.fake import FakeExecutor
from tests.helpers import SPEC_32, marked_array

REPO = Path(__file__).resolve().parent.parent


def gpu_check(tmp_path: Path, *args: str, timeout: float = 600) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "check.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--allow-cpu", "--out", str(out), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.exists(), proc.stdout + proc.stderr
    return proc.returncode, json.loads(out.read_text())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is")
def test_without_a_gpu_it_refuses_unless_allowed() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--allow-cpu" in proc.stdout


def test_sections_past_the_budget_are_skipped(tmp_path: Path) -> None:
    code, doc = gpu_check(tmp_path, "--quick", "--budget-s", "24", "--only", "env,decoders")
    assert code == 0
    assert doc["sections"] == {
        "env": {"status": "skipped", "error": "budget spent"},
        "decoders": {"status": "skipped", "error": "budget spent"},
    }


def test_skip_leaves_sections_out_of_the_run_and_its_budget(tmp_path: Path) -> None:
    plan = Plan("cuda:0", False, "ViT-B-32", 1, [2, 3], str(tmp_path))
    names = [name for name, _ in sections(plan)]
    kept = [n for n in names if chosen(n, ["executor:torch+fp16", "served"], ["served:jpeg"])]
    # A prefix keeps what it names and everything longer: --skip takes the longer one out.
    assert kept == [
        "executor:torch+fp16",
        "executor:torch+fp16+compile",
        "served:tensor-d2",
        "served:tensor-d3",
        "served:single",
    ]
    assert [n for n in kept if chosen(n, None, ["executor:torch+fp16+compile"])] == [
        "executor:torch+fp16",
        "served:tensor-d2",
        "served:tensor-d3",
        "served:single",
    ]
    full = default_budget(plan, ["executor:torch+fp16"], [])
    assert default_budget(plan, ["executor:torch+fp16"], ["executor:torch+fp16+"]) == full - 200


def test_served_loads_fit_the_body_budget() -> None:
    """The first GPU run's tensor load (64 requests of 64 images) overran the default 256 MiB
    and measured 503s; each load now asks for room for all its bodies, never below the default."""
    for payload in ("tensor", "single", "jpeg"):
        for quick in (False, True):
            load = Load.of(payload, quick)
            body = load.images_per_request * 224 * 224 * 3
            assert load.body_bytes() >= max(load.concurrency * body, 2**28)
    single = Load.of("single", False)
    assert (single.kind, single.images_per_request) == ("raw-tensor", 1)
    assert single.concurrency >= 256  # enough in flight to fill the batches of one engine


@pytest.mark.slow  # a multi-process or long variant: CI runs it (make test-slow)
def test_a_failing_section_is_recorded_and_the_run_goes_on(tmp_path: Path) -> None:
    code, doc = gpu_check(
        tmp_path, "--quick", "--model", str(tmp_path / "missing.json"), "--only", "executor,env"
    )
    assert code == 1
    failed, env = doc["sections"]["executor:torch"], doc["sections"]["env"]
    assert failed["status"] == "failed" and "missing.json" in failed["error"]
    assert env["status"] == "ok" and env["result"]["torch"] == torch.__version__
    assert doc["summary"]["engine_best_images_per_s"] == {"torch": None}


@pytest.mark.slow
def test_cpu_quick_run_end_to_end(tmp_path: Path) -> None:
    code, doc = gpu_check(tmp_path, "--quick", "--pipeline-depths", "2", timeout=900)
    sections = doc["sections"]
    assert list(sections) == [
        "env",
        "gpu-tests",
        "executor:torch",
        "pipelined:torch",
        "decoders",
        "served:tensor-d2",
        "served:single",
        "served:jpeg",
    ]
    assert {n: s["status"] for n, s in sections.items()} == dict.fromkeys(sections, "ok"), {
        n: s.get("error") for n, s in sections.items()
    }
    assert code == 0 and doc["mode"] == "cpu" and doc["quick"] and doc["gpu"] is None
    assert sections["gpu-tests"]["result"]["skipped"] == sections["gpu-tests"]["result"]["tests"]
    rows = sections["executor:torch"]["result"]["rows"]
    assert [r["batch"] for r in rows] == [1, 4, 16] and all(r["images_per_s"] > 0 for r in rows)
    decoders = sections["decoders"]["result"]
    assert decoders["pillow"]["images_per_s"] > 0 and decoders["device"]["images_per_s"] > 0
    assert decoders["decode_processes"]["cpu"]["rows_equal"] is True  # through shared memory
    for name in ("served:tensor-d2", "served:single", "served:jpeg"):
        served = sections[name]["result"]
        assert served["images_per_s"] > 0 and served["statuses"].get("200", 0) > 0
        # A window of 2.5 s with CPU batches of up to a second: edges weigh, hence the margin.
        assert isinstance(served["device_busy"], float) and 0 < served["device_busy"] <= 3
        # Who ran out first: one server process here (no --workers), and the load generator.
        assert served["cores_busy"]["root"] > 0 and served["cores_busy"]["load generator"] > 0
    summary = doc["summary"]
    assert summary["served_jpeg_images_per_s"] == sections["served:jpeg"]["result"]["images_per_s"]
    single = sections["served:single"]["result"]
    assert single["images_per_request"] == 1
    assert summary["served_single_requests_per_s"] == single["requests_per_s"] > 0
    assert set(summary["targets"]) == {"engine_fp16", "device_busy", "served_tensor", "served_jpeg"}


class CountingFake(FakeExecutor):
    """The fake's simulated stream, counting the batches launched and not yet waited for."""

    def __init__(self, **options: Any) -> None:
        super().__init__(SPEC_32, 16, stream=True, **options)
        self.in_flight = self.most_in_flight = 0
        self.counting = threading.Lock()  # launch and wait run on different threads

    def launch(self, arrays: Sequence[np.ndarray], normalize: np.ndarray) -> object:
        with self.counting:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        return super().launch(arrays, normalize)

    def wait(self, launched: object) -> np.ndarray:
        try:
            return super().wait(launched)
        finally:
            with self.counting:
                self.in_flight -= 1


class StaleRowsFake(CountingFake):
    """Hands every batch the rows of the first batch launched: a staging slot reused too
    early, as the check must catch."""

    first: np.ndarray | None = None

    def wait(self, launched: object) -> np.ndarray:
        rows = super().wait(launched)
        if self.first is None:
            self.first = rows
        return self.first.copy()


def batches(count: int, size: int) -> list[list[np.ndarray]]:
    return [[marked_array(10 * b + i + 1) for i in range(size)] for b in range(count)]


@pytest.fixture
def threads() -> Iterator[tuple[ThreadPoolExecutor, ThreadPoolExecutor]]:
    device, waiter = ThreadPoolExecutor(1), ThreadPoolExecutor(1)
    yield device, waiter
    device.shutdown()
    waiter.shutdown()


def test_launch_wait_rows_are_checked_against_run(
    threads: tuple[ThreadPoolExecutor, ThreadPoolExecutor],
) -> None:
    good, stale = CountingFake(), StaleRowsFake()
    try:
        assert check_launch_wait(good, *threads, batches(3, 4)) >= MIN_COSINE
        assert good.most_in_flight == 3  # all launched before any was waited for
        assert check_launch_wait(stale, *threads, batches(3, 4)) < 0.99
    finally:
        good.close()
        stale.close()


def test_a_row_that_is_not_finite_fails_the_floor() -> None:
    rows = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    assert min_cosine(rows, 2 * rows) == pytest.approx(1.0)
    broken = rows.copy()
    broken[1, 0] = np.nan
    assert min_cosine(broken, rows) == -1.0 and min_cosine(rows, broken) == -1.0


@pytest.mark.parametrize("depth", DEPTHS)
def test_launch_wait_keeps_depth_batches_in_flight(
    depth: int, threads: tuple[ThreadPoolExecutor, ThreadPoolExecutor]
) -> None:
    fake = CountingFake(latency_ms=5)
    device, waiter = threads
    try:
        batch = batches(1, 4)[0]
        timing = device.submit(time_launch_wait, fake, batch, depth, 0.05, waiter).result()
    finally:
        fake.close()
    assert fake.most_in_flight == depth and fake.in_flight == 0
    assert len(timing.latencies) >= MIN_BATCHES and timing.images == 4 * len(timing.latencies)
    assert fake.items_run == timing.images and timing.images_per_s > 0


def test_the_worker_row_pipelines_and_answers_every_batch(
    threads: tuple[ThreadPoolExecutor, ThreadPoolExecutor],
) -> None:
    fake = CountingFake(latency_ms=5)
    batch = batches(1, 4)[0]
    try:
        timing, kept, rows = time_worker(fake, threads[0], batch, 2, 0.05)
    finally:
        fake.close()
    assert kept == 2 and fake.most_in_flight == 2
    assert len(timing.latencies) >= MIN_BATCHES and fake.items_run == timing.images
    expected = fake.features(np.stack(batch)) @ fake._proj
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    np.testing.assert_allclose(rows, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # a multi-process or long variant: CI runs it (make test-slow)
def test_pipelined_section_on_the_cpu(tmp_path: Path) -> None:
    code, doc = gpu_check(tmp_path, "--quick", "--only", "pipelined", timeout=300)
    assert code == 0, doc["sections"]
    assert list(doc["sections"]) == ["pipelined:torch"]
    section = doc["sections"]["pipelined:torch"]
    assert section["status"] == "ok" and section["limit_s"] == doc["budget_s"] - 5
    result = section["result"]
    assert result["device"] == "cpu" and result["asynchronous"] is False
    check = result["check"]
    assert check["passed"] and set(check["min_cosine"]) == {"4", "16"}
    assert min(check["min_cosine"].values()) >= MIN_COSINE
    assert min(check["worker_min_cosine"].values()) >= MIN_COSINE
    modes = {(r["batch"], r["mode"], r["depth"]) for r in result["rows"]}
    expected = {(n, "run", 1) for n in (4, 16)}
    expected |= {(n, m, k) for n in (4, 16) for m in ("launch_wait", "worker") for k in DEPTHS}
    assert modes == expected and len(result["rows"]) == len(expected)
    for row in result["rows"]:
        rate, latency = row["images_per_s"], row["latency_ms"]
        assert 0 < rate["min"] <= rate["median"] <= rate["max"]
        assert 0 < latency["min"] <= latency["median"] <= latency["max"]
        assert row["batches"] >= result["rounds"] * MIN_BATCHES
        if row["mode"] == "run":
            assert row["vs_run"] == {"median": 1.0, "min": 1.0, "max": 1.0}
        if row["mode"] == "worker":  # the CPU's worker is synchronous whatever the depth
            assert row["effective_depth"] == 1
    summary = doc["summary"]["pipelined_vs_run"]["torch"]
    assert set(summary["vs_run"]) == {"4", "16"} and summary["min_cosine"] >= MIN_COSINE


def test_served_flags_spread_connections_only_with_front_ends(tmp_path: Path) -> None:
    known = "--workers --reuse-port --pipeline-depth"
    plan = Plan("cuda:0", False, "ViT-B-32", 4, [2], str(tmp_path), reuse_port=True)
    flags = server_flags(plan, known, depth=2, gpu_decode=False)
    assert flags[flags.index("--workers") + 1] == "4" and "--reuse-port" in flags
    one = Plan("cuda:0", False, "ViT-B-32", 1, [2], str(tmp_path), reuse_port=True)
    assert "--reuse-port" not in server_flags(one, known, depth=2, gpu_decode=False)
    # A server that predates the flag is asked for nothing it would refuse.
    assert "--reuse-port" not in server_flags(plan, "--workers", depth=2, gpu_decode=False)
