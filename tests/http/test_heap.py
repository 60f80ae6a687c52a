"""keep_body_pages: bodies of megabytes joined over and over land on pages already faulted in.
Each case runs in a fresh interpreter: malloc's settings are process-wide."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

from clipserve.http.heap import OPERATOR_SETTINGS

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


def run(code: str, *args: str, **env: str) -> str:
    """`code` in a fresh interpreter, without any malloc tunables but those given."""
    clean = {k: v for k, v in os.environ.items() if k not in OPERATOR_SETTINGS}
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        check=True,
        env={**clean, **env},
    )
    return out.stdout


def faults_per_body(mode: str) -> float:
    return float(run(JOINS, mode))


GLIBC = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(ctypes.CDLL(None), "mallopt"),
    reason="glibc's mallopt only",
)


@GLIBC
def test_joined_bodies_reuse_the_heap() -> None:
    pages = 37 * 256 * 1024 // 4096  # 2,368 a body
    kept, default = faults_per_body("kept"), faults_per_body("default")
    assert kept < pages / 20, (kept, default)
    # Without it each body faults in most of its pages again: what the setting is for.
    assert default > pages / 4, (kept, default)


@GLIBC
def test_an_operators_malloc_settings_are_left_alone() -> None:
    check = "from clipserve.http.heap import keep_body_pages; print(keep_body_pages(1 << 28, 4))"
    assert run(check).strip() == "True"
    for name in OPERATOR_SETTINGS:
        assert run(check, **{name: "glibc.malloc.trim_threshold=1"}).strip() == "False"
