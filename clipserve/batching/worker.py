"""One worker per device: takes batches from the shared queue and runs them on its own thread."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from clipserve.backends.base import Executor
from clipserve.batching.queue import BatchQueue, WorkItem
from clipserve.errors import ExecutorFailed, ExecutorFatal
from clipserve.metrics import Metrics

log = logging.getLogger(__name__)


def l2_normalise_rows(out: np.ndarray, mask: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    return np.where(mask[:, None], out / np.maximum(norms, 1e-12), out)


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
            batch = await self.queue.take(self.max_batch_size, self.max_delay_s)
            await self._run(batch)

    def _compute(self, arrays: list[np.ndarray], mask: np.ndarray) -> np.ndarray:
        """Runs on the device thread: stacking, the forward pass and L2 normalisation."""
        out = self.executor.run(np.stack(arrays))
        if out.ndim != 2 or out.shape[0] != len(arrays):
            raise RuntimeError(f"executor returned shape {out.shape} for {len(arrays)} images")
        return l2_normalise_rows(np.asarray(out, dtype=np.float32), mask)

    async def _run(self, batch: list[WorkItem]) -> None:
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        for item in batch:
            item.started_at = started
            item.ticket.release(1)
        mask = np.array([item.normalize for item in batch])
        try:
            out = await loop.run_in_executor(
                self._thread, self._compute, [item.array for item in batch], mask
            )
        except ExecutorFatal:
            self._fail(batch, "device lost")
            raise  # ends this worker; /readyz reports it
        except Exception:
            self._fail(batch, "executor error")
            return
        finished = time.perf_counter()
        self.metrics.observe_batch(self.device, len(batch), finished - started, self.kind)
        for item, row in zip(batch, out, strict=True):
            item.finished_at = finished
            if not item.future.done():
                item.future.set_result(row)

    def _fail(self, batch: list[WorkItem], what: str) -> None:
        ids = sorted({item.request_id for item in batch})
        log.exception(
            "%s on %s failed a batch of %d; request ids: %s",
            what,
            self.device,
            len(batch),
            ", ".join(ids),
        )
        self.metrics.batch_failures.labels(self.device).inc()
        for item in batch:
            if not item.future.done():
                item.future.set_exception(ExecutorFailed("internal error"))
