"""The garbage collector while a process serves: startup's objects frozen, young collections
rare.

Freezing: what startup built (the model, torch: ~400k objects) lives as long as the server; out
of the collector's sight, full collections under load stop stalling the loop 0.3-0.8 s
(bench/goodput.py: p99 of 503s 830 -> 15 ms).

The young generation's threshold: under load the tracked objects alive at once rise and fall
with the requests in flight by more than CPython's default of 700, so a collection ran every ~11
tensor requests at 64 connections: ~36 µs of each one's CPU, scanning the same live requests
again and again. Little survives a request (at 5,000 no collection ran in 10,000 requests), so a
higher threshold makes collections rare without letting garbage pile up; one scans at most this
many young objects (about a millisecond). Measured in bench/results/gc-threshold-2026-11-27.json.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

YOUNG_THRESHOLD = 10_000


@contextmanager
def serving() -> Iterator[None]:
    """Around a process's serving: startup frozen, the young threshold raised; both undone
    after (a test's server in this process leaves the collector as it found it)."""
    before = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
