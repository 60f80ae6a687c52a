"""`bench/engine_link.py`: the engine alone under the real front-end link must serve every
request it is sent and count the engine's own CPU, or its rounds measure nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ENGINE_LINK = Path(__file__).resolve().parent.parent / "bench" / "engine_link.py"


@pytest.mark.slow
def test_one_point_serves_requests_through_the_engine_and_counts_its_cpu() -> None:
    argv = [sys.executable, str(ENGINE_LINK), "--one", "--seconds", "0.5", "--connections", "8"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=300)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["requests"] > 50
    assert row["requests_per_s"] > 0
    # Two threads work in the engine (its loop and the device thread): both counted.
    loop_us, device_us = row["busiest_threads_us_per_request"]
    assert loop_us > 0 and device_us > 0
    assert row["engine_cpu_us_per_request"] >= loop_us + device_us - 0.01
