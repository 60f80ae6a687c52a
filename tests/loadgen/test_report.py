"""`clipserve-bench report --quick` end to end: servers started as subprocesses, every section."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_quick_report_writes_every_section(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "clipserve.loadgen", "report", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (out,) = tmp_path.iterdir()
    assert out.name.endswith("-quick") and out.name[:4].isdigit()  # date-machine-quick
    report = (out / "report.md").read_text()
    for title in (
        "Executors",
        "Wire formats",
        "Queue delay x concurrency",
        "Device scaling",
        "No batching",
        "The load generator's own ceiling",
    ):
        assert f"## {title}" in report
    assert "**Failed**" not in report
    doc = json.loads((out / "report.json").read_text())
    assert doc["quick"] and doc["machine"]["cores"]
    served = {row["payload"]: row for row in doc["protocols"]["data"]}
    assert all(row["ok"] > 0 and row["completed"] == row["ok"] for row in served.values())
    devices = doc["devices"]["data"]
    assert devices[-1]["images_per_s"] > devices[0]["images_per_s"]  # 4 devices beat 1
    assert (out / "grid.png").stat().st_size > 10_000
