"""keep_body_pages: bodies of megabytes joined over and over land on pages already faulted in.
Each case runs in a fresh interpreter: malloc's settings are process-wide."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

# Eight 9.6 MB bodies in flight, joined from 256 KiB chunks (uvloop's reads), ten times over;
# prints the minor page faults per body after a warm-up.
JOINS = """
import resource, sys
from clipserve.http.heap import keep_body_pages
if sys.argv[1] == "kept":
    assert keep_body_pages(256 << 20)
chunks = [bytes(256 << 10) for _ in range(37)]
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def bodies():
    alive = [b"".join(chunks) for _ in range(8)]
    del alive
for _ in range(3):
    bodies()
before = faults()
for _ in range(10):
    bodies()
print((faults() - before) / 80)
"""


def faults_per_body(mode: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", JOINS, mode], capture_output=True, text=True, check=True
    )
    return float(out.stdout)


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(ctypes.CDLL(None), "mallopt"),
    reason="glibc's mallopt only",
)
def test_joined_bodies_reuse_the_heap() -> None:
    pages = 37 * 256 * 1024 // 4096  # 2,368 a body
    kept, default = faults_per_body("kept"), faults_per_body("default")
    assert kept < pages / 20, (kept, default)
    # Without it each body faults in most of its pages again: what the setting is for.
    assert default > pages / 4, (kept, default)
