"""bench/gpu_check/proc_cpu.py on real processes: a root with a child that holds a listening
socket (a front end) and one that burns a thread (an engine), told apart and timed from /proc."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.gpu_check.proc_cpu import cores_busy, listening_inodes, snapshot

pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux /proc")

# The root: starts a front end (listens, then spins) and an engine (one spinning thread beside
# an idle one), prints the front end's port, and waits.
ROOT = """
import subprocess, sys
FRONT = '''
import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
print(s.getsockname()[1], flush=True)
while True:
    pass
'''
ENGINE = '''
import threading, time
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
while True:
    pass
'''
front = subprocess.Popen([sys.executable, "-c", FRONT], stdout=subprocess.PIPE, text=True)
engine = subprocess.Popen([sys.executable, "-c", ENGINE])
print(front.stdout.readline().strip(), flush=True)
sys.stdin.read()
front.kill(); engine.kill()
"""


def test_roles_and_the_engines_busiest_thread() -> None:
    root = subprocess.Popen(
        [sys.executable, "-c", ROOT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert root.stdout is not None
        port = int(root.stdout.readline())
        assert listening_inodes(port)  # the front end's socket, as /proc/net/tcp lists it
        before, t0 = snapshot(root.pid, port), time.monotonic()
        time.sleep(1.0)
        after, wall = snapshot(root.pid, port), time.monotonic() - t0
        busy = cores_busy(before, after, wall)
        assert set(busy) == {"root", "front ends", "engine", "engine busiest thread"}
        # Two spinning processes on a machine of two or more cores: each gets a good share,
        # the root (waiting on stdin) next to none, and the engine's CPU is its one thread's.
        assert busy["front ends"] > 0.2 and busy["engine"] > 0.2, busy
        assert busy["root"] < 0.1, busy
        assert busy["engine busiest thread"] == pytest.approx(busy["engine"], abs=0.05)
        assert len(after.engine_threads) == 2
    finally:
        root.communicate("", timeout=10)


LONE = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("up", flush=True)
sys.stdin.read()
child.kill()
"""


def test_no_front_ends_means_no_engine() -> None:
    """With one front end the root serves and holds the port itself: its children (a decode
    process, the resource tracker) are "other", never the engine."""
    root = subprocess.Popen(
        [sys.executable, "-c", LONE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert root.stdout is not None and root.stdout.readline().strip() == "up"
        snap = snapshot(root.pid, 1)  # nothing listens on port 1
        assert set(snap.by_role) == {"root", "other"} and not snap.engine_threads
    finally:
        root.communicate("", timeout=10)
