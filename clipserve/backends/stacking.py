"""A batch's images stacked into one host array, in chunks on a few threads when it is large.

A batch of 256 224x224 RGB images is 38 MB. One `np.stack` copies it on one core: on the H200
host a launch-and-wait of batch 256 took 16.2 ms against `run()`'s 10.5 ms for the same batch,
whose copy into pinned memory runs on torch's threads (docs/gpu-status.md, second run). numpy
releases the GIL while it copies, so chunks copied on a few threads run side by side
(bench/stacking.py).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np

from clipserve.config import resolve_workers

CHUNK_BYTES = 4 << 20  # smaller chunks would not repay a pool round trip (tens of microseconds)
MAX_THREADS = 4  # host memory bandwidth, not cores, bounds a copy; the rest serve requests

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def threads_for(nbytes: int, cores: int) -> int:
    """Threads to copy `nbytes` with: one per CHUNK_BYTES, at most MAX_THREADS and `cores`."""
    return max(1, min(MAX_THREADS, cores, nbytes // CHUNK_BYTES))


def _forget_pool() -> None:
    """In a forked child: the parent's pool threads do not exist there."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _shared_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(MAX_THREADS - 1, thread_name_prefix="clipserve-stack")
        return _pool


def stack_into(arrays: Sequence[np.ndarray], out: np.ndarray) -> np.ndarray:
    """`np.stack(arrays, out=out[:n])`, the same result and errors, in parallel chunks when the
    batch is large; the calling thread copies one chunk itself. Returns `out[:n]`."""
    n = len(arrays)
    dest = out[:n]
    # The cores this process may run on: a server pinned to one core copies on one thread.
    threads = threads_for(n * arrays[0].nbytes, resolve_workers(0)) if n else 1
    if threads == 1:
        np.stack(arrays, out=dest)
        return dest
    step = -(-n // threads)
    chunks = [(i, i + step) for i in range(step, n, step)]
    pool = _shared_pool()
    others: list[Future[np.ndarray]] = []
    try:
        for lo, hi in chunks:
            others.append(pool.submit(np.stack, arrays[lo:hi], out=dest[lo:hi]))
        np.stack(arrays[:step], out=dest[:step])
        # Chunks still queued (the pool is shared by every device thread) are copied here
        # rather than waited for behind another caller's.
        for (lo, hi), future in zip(chunks, others, strict=False):
            if future.cancel():
                np.stack(arrays[lo:hi], out=dest[lo:hi])
    finally:  # no chunk may still be writing into `out` once this returns, even on an error
        for future in others:
            future.cancel()
        wait(others)
    for future in others:
        if not future.cancelled():
            future.result()  # a chunk's error (shapes or dtypes that do not match) raised here
    return dest


def stack(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """`np.stack(arrays)` for arrays of one shape and dtype (a batch), in parallel chunks when
    the batch is large."""
    if not arrays:
        return np.stack(arrays)  # numpy's own error for an empty batch
    first = arrays[0]
    return stack_into(arrays, np.empty((len(arrays), *first.shape), first.dtype))
