"""bench/gpu_check/proc_cpu.py on real processes: a root with a child that holds a listening
socket (a front end), one that spins its main thread beside an idle one and has a spinning
child of its own (an engine), and a resource tracker, told apart and timed from /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.gpu_check.proc_cpu import cores_busy, listening_inodes, snapshot

pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux /proc")

FRONT = """
import socket
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
print(s.getsockname()[1], flush=True)
while True:
    pass
"""
ENGINE = """
import subprocess, sys, threading, time
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
print(child.pid, flush=True)
while True:
    pass
"""
TRACKER = "import time  # multiprocessing.resource_tracker\ntime.sleep(600)"
# The root starts the three, waits until each is up, prints the front end's port and the
# engine's pid and its child's, and waits for its stdin to close.
ROOT = f"""
import subprocess, sys
run = lambda code: subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
front, engine, tracker = run({FRONT!r}), run({ENGINE!r}), run({TRACKER!r})
port, grandchild = front.stdout.readline().strip(), engine.stdout.readline().strip()
print(port, engine.pid, grandchild, flush=True)
sys.stdin.read()
subprocess.run(["kill", grandchild])
for p in (front, engine, tracker):
    p.kill()
"""


def test_roles_threads_and_the_host() -> None:
    root = subprocess.Popen(
        [sys.executable, "-c", ROOT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert root.stdout is not None
        port, engine, _ = (int(x) for x in root.stdout.readline().split())
        assert listening_inodes(port)  # the front end's socket, as /proc/net/tcp lists it
        before, t0 = snapshot(root.pid, port), time.monotonic()
        time.sleep(1.0)
        after, wall = snapshot(root.pid, port), time.monotonic() - t0
        busy = cores_busy(before, after, wall)
        assert after.engine_pid == engine and len(after.engine_threads) == 2
        assert set(busy) == {
            "root",
            "front ends",
            "engine",
            "other",
            "engine loop thread",
            "engine busiest other thread",
            "host",
        }, busy
        # Three spinners (the front end, the engine's main thread and its child) on a machine
        # of two or more cores: each gets a good share, at most a core; the root, the idle
        # thread and the resource tracker next to none; the engine counts its child.
        for one in (busy["front ends"], busy["engine loop thread"]):
            assert 0.2 < one < 1.2, busy
        assert busy["engine"] > busy["engine loop thread"] + 0.1, busy
        assert busy["root"] < 0.1 and busy["other"] < 0.1, busy
        assert busy["engine busiest other thread"] < 0.1, busy
        assert busy["host"] > busy["front ends"] + busy["engine"] - 0.3, busy
        assert busy["host"] < (os.cpu_count() or 1) + 0.2, busy
    finally:
        root.communicate("", timeout=10)


LONE = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(child.pid, flush=True)
sys.stdin.read()
child.kill()
"""


def test_no_front_ends_means_no_engine() -> None:
    """With one front end the root serves and holds the port itself: its children (a decode
    process, the resource tracker) are "other", never the engine. A tree given by role (the
    load generator's) is counted under that role, and a role whose processes changed between
    two snapshots is named."""
    root = subprocess.Popen(
        [sys.executable, "-c", LONE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert root.stdout is not None
        child = int(root.stdout.readline())
        before = snapshot(root.pid, 1)  # nothing listens on port 1
        assert set(before.by_role) == {"root", "other"} and not before.engine_threads
        after = snapshot(root.pid, 1, {"load generator": child})
        assert after.pids["load generator"] == {child}
        busy = cores_busy(before, after, 1.0)
        assert busy["changed during the window"] == ["load generator"]
    finally:
        root.communicate("", timeout=10)
