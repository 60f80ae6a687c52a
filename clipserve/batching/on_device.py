"""One GPU-decoded batch on its device thread: its crops stay on the device and go to the
executor as they are (`PixelExecutor`); only a batch that fails comes back to the host, to be
bisected through `compute` as any other batch is.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from clipserve.backends.base import PixelExecutor, l2_normalise_rows
from clipserve.backends.device import fatal_device_errors
from clipserve.batching.compute import LOST, Outcome, check_shape, compute, finite, rows_of
from clipserve.errors import ExecutorFatal, NotReady

if TYPE_CHECKING:  # imports torch: only with --decode gpu
    from clipserve.inference.gpu_decode import DecodedBatch


def compute_pixels(
    executor: PixelExecutor,
    decoded: DecodedBatch,
    mask: np.ndarray,
    failed: Exception | None = None,
) -> Outcome:
    """`compute` for a decoded batch: the whole batch from its device tensor, rows
    L2-normalised where `mask` is true. `failed`: it failed whole already (launched
    asynchronously); then, or when this run fails, its crops come to the host and the batch is
    bisected through `executor.run`."""
    t0 = time.perf_counter()
    n = len(decoded.ok)
    if failed is None:
        try:
            out = executor.run_pixels(decoded.pixels)
            check_shape(out, n)
            block = l2_normalise_rows(np.asarray(out, dtype=np.float32), mask)
            rows = rows_of(block)
            return Outcome(
                rows, device_s=time.perf_counter() - t0, block=block if finite(rows) else None
            )
        except Exception as exc:  # out of memory included: smaller batches may fit
            failed = exc
    if isinstance(failed, ExecutorFatal):  # the device is gone: its memory with it
        return Outcome([NotReady(LOST) for _ in range(n)], fatal=failed)
    try:
        with fatal_device_errors(executor.info.device):
            arrays = list(_host_crops(decoded))
    except ExecutorFatal as exc:
        return Outcome([NotReady(LOST) for _ in range(n)], fatal=exc)
    return compute(executor, arrays, mask, failed)


def _host_crops(decoded: DecodedBatch) -> np.ndarray:
    from clipserve.inference.gpu_decode import crops_numpy

    return crops_numpy(decoded)
