"""One batch on its device thread: stacking, the forward pass and L2 normalisation, and the
bisection of a batch that fails, so that only the items that fail on their own are answered 500.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from clipserve.backends.base import Executor, l2_normalise_rows
from clipserve.backends.stacking import stack_into
from clipserve.errors import (
    ClipserveError,
    ExecutorFailed,
    ExecutorFatal,
    NonFiniteEmbedding,
    NotReady,
)

# A failing batch is split in halves, and failing halves again, this many times at most: enough
# to isolate single items in batches of up to 256, and bounded when every item fails.
MAX_SPLIT_DEPTH = 8
LOST = "the device was lost before this item was computed; retry"
# Rows the executor did not compute: the batch failed, or the device was lost under it.
UNANSWERED = (ExecutorFailed, NotReady)
# A place in a batch's outcome before its row or error is written; never answered with.
_UNSET = ExecutorFailed("internal error")


@dataclass
class Outcome:
    """What the device thread made of one batch: per item, its row or the error to answer."""

    rows: list[np.ndarray | ClipserveError]
    retries: int = 0  # sub-batches run again after a failure
    errors: list[Exception] = field(default_factory=list)  # executor failures, for the log
    fatal: ExecutorFatal | None = None
    device_s: float = 0.0  # the device's time on this batch, not counting waits behind others
    # Every row, as one (N, D) array, when the whole batch ran at once and every row is finite:
    # a request's items are then answered a slice at a time (`DeviceWorker._settle`).
    block: np.ndarray | None = None

    @property
    def clean(self) -> bool:
        return not self.retries and not self.errors and self.fatal is None

    def non_finite(self) -> int:
        """Rows refused for NaN or infinity: a model fault, counted apart from clients'."""
        return sum(1 for row in self.rows if isinstance(row, NonFiniteEmbedding))


def compute(
    executor: Executor, arrays: list[np.ndarray], mask: np.ndarray, failed: Exception | None = None
) -> Outcome:
    """Run `arrays` through `executor` on its device thread, rows L2-normalised where `mask` is
    true. `failed`: the batch already failed whole (launched asynchronously); start by splitting."""
    t0 = time.perf_counter()
    outcome = Outcome([_UNSET] * len(arrays))  # every place is written below
    if isinstance(failed, ExecutorFatal):
        outcome.fatal = failed
        failed = None
    _Bisection(executor, _stacked(arrays), mask, outcome).run(0, len(arrays), 0, failed)
    outcome.device_s = time.perf_counter() - t0
    return outcome


# Per device thread, each kind of batch's host memory, reused batch after batch: a fresh 38 MB
# batch (256 images at 224x224) page-faults on every use, 1.7x the copy's own time here
# (bench/results/stacking-2026-11-27.json). Safe because a batch is done with when `compute`
# returns: executors return memory of their own (a synchronous `run`), and the rows handed on
# are L2-normalised into new arrays. Kinds are the towers' input layouts: a handful.
_scratch = threading.local()
MAX_SCRATCH_KINDS = 4


def _stacked(arrays: list[np.ndarray]) -> np.ndarray:
    """`np.stack(arrays)` into this thread's reused memory for batches of that kind. A batch
    is one dtype and shape (the queue's lanes), so the first array's are the batch's."""
    first = arrays[0]
    kind = (first.dtype.str, first.shape)
    buffers: dict[tuple[str, tuple[int, ...]], np.ndarray] = _scratch.__dict__.setdefault(
        "buffers", {}
    )
    buf = buffers.get(kind)
    if buf is None or len(buf) < len(arrays):
        if buf is None and len(buffers) >= MAX_SCRATCH_KINDS:
            buffers.clear()
        buf = buffers[kind] = np.empty((len(arrays), *first.shape), first.dtype)
    return stack_into(arrays, buf)


@dataclass
class _Bisection:
    """A batch, run whole and then in halves where it fails, each result written into `outcome`
    at its items' places."""

    executor: Executor
    batch: np.ndarray
    mask: np.ndarray
    outcome: Outcome

    def run(self, start: int, stop: int, depth: int, failed: Exception | None = None) -> None:
        """Items start..stop-1, `depth` splits down; `failed`: they failed together already."""
        outcome = self.outcome
        out: np.ndarray | None = None
        if outcome.fatal is None and failed is None:
            try:
                out = self._forward(start, stop)
            except ExecutorFatal as exc:
                outcome.fatal = exc
            except Exception as exc:  # CUDA out-of-memory included: smaller batches may fit
                failed = exc
        if outcome.fatal is not None:  # the device is gone: the rest may be computed elsewhere
            outcome.rows[start:stop] = [NotReady(LOST) for _ in range(start, stop)]
            return
        if out is None:  # split outside the handler, so tracebacks do not chain
            assert failed is not None
            if stop - start == 1 or depth >= MAX_SPLIT_DEPTH:
                outcome.errors.append(failed)
                outcome.rows[start:stop] = [
                    ExecutorFailed("internal error") for _ in range(start, stop)
                ]
                return
            mid = start + (stop - start) // 2
            outcome.retries += 2
            self.run(start, mid, depth + 1)
            self.run(mid, stop, depth + 1)
            return
        rows = rows_of(out)
        outcome.rows[start : start + len(rows)] = rows
        if depth == 0 and stop - start == len(outcome.rows) and finite(rows):
            outcome.block = out

    def _forward(self, start: int, stop: int) -> np.ndarray:
        batch = self.batch[start:stop]
        out = self.executor.run(batch)
        check_shape(out, len(batch))
        return l2_normalise_rows(np.asarray(out, dtype=np.float32), self.mask[start:stop])


def check_shape(out: np.ndarray, size: int) -> None:
    if out.ndim != 2 or out.shape[0] != size:
        raise RuntimeError(f"executor returned shape {out.shape} for {size} images")


def finite(rows: list[np.ndarray | ClipserveError]) -> bool:
    """Whether `rows_of` found every row finite."""
    for row in rows:  # noqa: SIM110 (a plain loop over a list: faster than any() here)
        if not isinstance(row, np.ndarray):
            return False
    return True


def rows_of(out: np.ndarray) -> list[np.ndarray | ClipserveError]:
    """One row per item; a row with NaN or infinity fails only its own item."""
    rows: list[np.ndarray | ClipserveError] = list(out)
    for i in np.flatnonzero(~np.isfinite(out).all(axis=1)):
        rows[i] = NonFiniteEmbedding(
            "the model produced non-finite values (NaN or infinity) for this input"
        )
    return rows
