"""The garbage collector while a process serves: startup's objects frozen, young collections
rare.

Freezing: what startup built (the model, torch: ~400k objects) lives as long as the server; out
of the collector's sight, full collections under load stop stalling the loop 0.3-0.8 s
(bench/goodput.py: p99 of 503s 830 -> 15 ms).

The young generation's threshold: under load the tracked objects alive at once rise and fall
with the requests in flight by more than CPython's default of 700, so under `--workers 1` a
collection ran every ~11 tensor requests at 64 connections: ~36 µs of each one's CPU, scanning
the same live requests again and again (front ends under `--workers N` hold fewer objects per
request and crossed it rarely). Little survives a request (at 5,000 no collection ran in 10,000
requests), so a higher threshold makes collections rare without letting garbage pile up; one
scans at most this many young objects (about a millisecond). docs/measurements.md, round 9.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

YOUNG_THRESHOLD = 10_000

# The collector is the process's: servers that overlap in one process (tests run several) share
# one raised threshold, restored and unfrozen when the last of them stops.
_lock = threading.Lock()
_serving = 0
_before = gc.get_threshold()


@contextmanager
def serving() -> Iterator[None]:
    """Around a process's serving: what exists now frozen, the young threshold raised; both
    undone when the last server of the process stops."""
    global _serving, _before
    with _lock:
        if _serving == 0:
            _before = gc.get_threshold()
            gc.set_threshold(YOUNG_THRESHOLD, *_before[1:])
        _serving += 1
        gc.freeze()  # this server's startup too, when another serves already
    try:
        yield
    finally:
        with _lock:
            _serving -= 1
            if _serving == 0:
                gc.set_threshold(*_before)
                gc.unfreeze()
