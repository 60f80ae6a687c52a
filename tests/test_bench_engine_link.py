"""`bench/engine_link.py`: the engine alone under the real front-end link must serve every
request it is sent and count the engine's own CPU (or instructions), or its rounds measure
nothing."""

from __future__ import annotations

import json
import shutil
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


@pytest.mark.slow
@pytest.mark.skipif(
    not (shutil.which("valgrind") and shutil.which("callgrind_control")), reason="needs callgrind"
)
def test_callgrind_counts_the_engines_instructions_per_request() -> None:
    def counted(per_client: int) -> int:
        argv = [sys.executable, str(ENGINE_LINK), "--count", str(per_client)]
        argv += ["--connections", "4"]
        out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=600)
        return int(out.stdout.strip().splitlines()[-1])

    small, large = counted(2), counted(8)  # 8 and 32 requests, start-up not counted
    per_request = (large - small) / 24
    # One single-image request through the engine is ~0.4M instructions (the batch's copy of
    # 150 KB counts ~150k of them); the start-up (imports, the model) is far more, and would
    # show if it were counted.
    assert 100_000 < per_request < 2_000_000
    assert small < large < 10 * small
