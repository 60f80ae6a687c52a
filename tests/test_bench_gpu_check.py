"""`python -m bench.gpu_check`: its CPU mode end to end (slow), and how it records sections that
fail or do not fit the budget."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

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
        "decoders",
        "served:tensor-d2",
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
    for name in ("served:tensor-d2", "served:jpeg"):
        served = sections[name]["result"]
        assert served["images_per_s"] > 0 and served["statuses"].get("200", 0) > 0
        # A window of 2.5 s with CPU batches of up to a second: edges weigh, hence the margin.
        assert isinstance(served["device_busy"], float) and 0 < served["device_busy"] <= 3
    summary = doc["summary"]
    assert summary["served_jpeg_images_per_s"] == sections["served:jpeg"]["result"]["images_per_s"]
    assert set(summary["targets"]) == {"engine_fp16", "device_busy", "served_tensor", "served_jpeg"}
