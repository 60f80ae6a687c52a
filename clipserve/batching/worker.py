"""One worker per device: takes batches from the shared queue and runs them on its own thread."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from clipserve.backends.base import Executor
from clipserve.batching.cost import CostModel
from clipserve.batching.queue import BatchQueue, WorkItem
from clipserve.errors import (
    ClipserveError,
    ExecutorFailed,
    ExecutorFatal,
    NonFiniteEmbedding,
    NotReady,
)
from clipserve.metrics import Metrics

log = logging.getLogger(__name__)

# A failing batch is split in halves, and failing halves again, this many times at most: enough
# to isolate single items in batches of up to 256, and bounded when every item fails.
MAX_SPLIT_DEPTH = 8


def l2_normalise_rows(out: np.ndarray, mask: np.ndarray) -> np.ndarray:
    # Norms in float64: squares of large finite float32 values overflow float32 to inf. Rows
    # that are already NaN or infinite stay so, quietly: the caller refuses them.
    with np.errstate(over="ignore", invalid="ignore"):
        norms = np.linalg.norm(out.astype(np.float64), axis=1, keepdims=True)
        scaled = (out / np.maximum(norms, 1e-12)).astype(np.float32)
    return np.where(mask[:, None], scaled, out)


@dataclass
class Outcome:
    """What the device thread made of one batch: per item, its row or the error to answer."""

    rows: list[np.ndarray | ClipserveError]
    retries: int = 0  # sub-batches run again after a failure
    errors: list[Exception] = field(default_factory=list)  # executor failures, for the log
    fatal: ExecutorFatal | None = None

    @property
    def clean(self) -> bool:
        return not self.retries and not self.errors and self.fatal is None


class DeviceWorker:
    def __init__(
        self,
        executor: Executor,
        queue: BatchQueue,
        *,
        max_batch_size: int,
        max_delay_s: float,
        metrics: Metrics,
        thread: ThreadPoolExecutor | None = None,
        on_death: Callable[[], None] = lambda: None,
        kind: str = "image",
    ) -> None:
        self.kind = kind
        self.executor = executor
        self.device = executor.info.device
        self.queue = queue
        self.max_batch_size = max_batch_size
        self.max_delay_s = max_delay_s
        self.metrics = metrics
        self.on_death = on_death
        self.cost = CostModel()  # learned from this worker's clean batches
        self.running: tuple[float, int] | None = None  # (started, size) of the batch computing
        # The executor is only ever called from one thread: the runtime's thread that built it,
        # or a dedicated one made here (and shut down by stop()).
        self._owns_thread = thread is None
        self._thread = thread or ThreadPoolExecutor(
            1, thread_name_prefix=f"clipserve-{self.device}"
        )
        self._task: asyncio.Task[None] | None = None
        self.error: str | None = None

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    def remaining_s(self, now: float) -> float:
        """Estimated seconds until the batch computing now finishes; 0 when idle."""
        if self.running is None:
            return 0.0
        started, size = self.running
        return max(started + self.cost.seconds(size) - now, 0.0)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"{self.kind}-worker-{self.device}")
        self._task.add_done_callback(self._on_exit)

    def _on_exit(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        self.error = f"{type(exc).__name__}: {exc}" if exc else "worker exited"
        log.critical("%s worker for %s stopped: %s", self.kind, self.device, self.error)
        self.on_death()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._owns_thread:
            self._thread.shutdown(wait=True)

    async def _loop(self) -> None:
        while True:
            batch = await self.queue.take(self.max_batch_size, self.max_delay_s, self.cost.seconds)
            await self._run(batch)

    def _forward(self, batch: np.ndarray, mask: np.ndarray) -> np.ndarray:
        out = self.executor.run(batch)
        if out.ndim != 2 or out.shape[0] != len(batch):
            raise RuntimeError(f"executor returned shape {out.shape} for {len(batch)} images")
        return l2_normalise_rows(np.asarray(out, dtype=np.float32), mask)

    def _compute(self, arrays: list[np.ndarray], mask: np.ndarray) -> Outcome:
        """Runs on the device thread: stacking, the forward pass and L2 normalisation; a failing
        batch is bisected so that only the items that fail on their own are answered 500."""
        outcome = Outcome([ExecutorFailed("internal error") for _ in arrays])
        self._bisect(np.stack(arrays), mask, 0, outcome, depth=0)
        return outcome

    def _bisect(
        self, batch: np.ndarray, mask: np.ndarray, offset: int, outcome: Outcome, depth: int
    ) -> None:
        out: np.ndarray | None = None
        if outcome.fatal is None:
            try:
                out = self._forward(batch, mask)
            except ExecutorFatal as exc:
                outcome.fatal = exc
            except Exception as exc:  # CUDA out-of-memory included: smaller batches may fit
                if len(batch) == 1 or depth >= MAX_SPLIT_DEPTH:
                    outcome.errors.append(exc)
                    return
        if (
            outcome.fatal is not None
        ):  # the device is gone: what it did not compute may go elsewhere
            outcome.rows[offset : offset + len(batch)] = [
                NotReady("the device was lost before this image was computed; retry") for _ in batch
            ]
            return
        if out is None:  # split outside the handler, so tracebacks do not chain
            mid = len(batch) // 2
            outcome.retries += 2
            self._bisect(batch[:mid], mask[:mid], offset, outcome, depth + 1)
            self._bisect(batch[mid:], mask[mid:], offset + mid, outcome, depth + 1)
            return
        rows: list[np.ndarray | ClipserveError] = list(out)
        for i in np.flatnonzero(~np.isfinite(out).all(axis=1)):  # only these rows fail
            rows[i] = NonFiniteEmbedding(
                "the model produced non-finite values (NaN or infinity) for this input"
            )
        outcome.rows[offset : offset + len(rows)] = rows

    async def _run(self, batch: list[WorkItem]) -> None:
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        self.running = (started, len(batch))
        for item in batch:
            item.started_at = started
            item.ticket.release(1)
        mask = np.array([item.normalize for item in batch])
        try:
            outcome = await loop.run_in_executor(
                self._thread, self._compute, [item.array for item in batch], mask
            )
        except Exception as exc:  # not from the executor (the thread pool itself): fail all
            outcome = Outcome([ExecutorFailed("internal error") for _ in batch], errors=[exc])
        except asyncio.CancelledError:  # stop() while computing: answer, do not strand them
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(NotReady("server is shutting down"))
            raise
        finally:
            self.running = None
        finished = time.perf_counter()
        computed = sum(1 for row in outcome.rows if isinstance(row, np.ndarray))
        if outcome.clean:
            self.cost.observe(len(batch), finished - started)
            self.metrics.observe_batch(self.device, len(batch), finished - started, self.kind)
        else:
            self.metrics.count_items(computed, self.kind)
            self.metrics.batch_retries.labels(self.device).inc(outcome.retries)
            self._log_failure(batch, outcome)
        for item, row in zip(batch, outcome.rows, strict=True):
            item.finished_at = finished
            if item.future.done():
                continue
            if isinstance(row, np.ndarray):
                item.future.set_result(row)
            else:
                item.future.set_exception(row)
        if outcome.fatal is not None:
            raise outcome.fatal  # ends this worker; /readyz reports it

    def _log_failure(self, batch: list[WorkItem], outcome: Outcome) -> None:
        if not outcome.errors and outcome.fatal is None:
            return  # bisected, yet every part ran: a transient failure
        self.metrics.batch_failures.labels(self.device).inc()
        failed = sorted(
            {item.request_id for item, row in zip(batch, outcome.rows, strict=True)
             if isinstance(row, (ExecutorFailed, NotReady))}
        )  # fmt: skip
        error = outcome.fatal or outcome.errors[0]
        log.error(
            "%s on %s failed %d of a batch of %d after %d retries; request ids: %s",
            "device lost" if outcome.fatal else "executor error",
            self.device,
            sum(isinstance(row, (ExecutorFailed, NotReady)) for row in outcome.rows),
            len(batch),
            outcome.retries,
            ", ".join(failed),
            exc_info=error,
        )
