"""Request bodies and glibc's heap: freed body memory kept for the next body.

A body of megabytes (a batch of uint8 tensors) arrives in chunks that the request joins into
one bytes object. glibc serves an allocation that size by mmap, or from the top of the heap,
which it gives back to the kernel once 128 KiB lies free there (its thresholds adapt, but not
past several bodies in flight). Either way the next body lands on new pages, and the kernel
faults in and zeroes each one while the join copies into it. With both thresholds set, bodies
below 32 MiB (the default --max-body-bytes) come from the heap, and an arena keeps up to the
process's share of the body budget free at its top for the next ones (freed holes below the
top stay too, as they always do). bench/large_bodies.py (requests of 64 tensors, 9.6 MB): page
faults 225 -> 0.9 a request, system time 2.9 -> 2.0 ms, CPU a request 0.92x (medians).
An operator's own MALLOC_* or GLIBC_TUNABLES settings are left as they are.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024
INT_MAX = 2**31 - 1
OPERATOR_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")


def keep_body_pages(body_bytes_in_flight: int, processes: int = 1) -> bool:
    """Keep up to this process's share of `body_bytes_in_flight` (--max-body-bytes-in-flight,
    shared by `processes` front ends) of freed heap, and serve allocations below 32 MiB from the
    heap. True where glibc took both; off glibc (musl, macOS), or where the environment sets
    malloc's tunables, nothing changes."""
    if not sys.platform.startswith("linux") or any(v in os.environ for v in OPERATOR_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no mallopt in this C library
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    share = min(max(body_bytes_in_flight // max(processes, 1), 0), INT_MAX)
    kept: bool = mallopt(M_TRIM_THRESHOLD, share) == 1
    return kept and bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1)
