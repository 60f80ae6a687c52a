"""The dynamic batcher: admission, one shared queue, one supervised worker per executor."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from clipserve.backends.base import Executor
from clipserve.batching.queue import Admission, BatchQueue, Ticket, WorkItem
from clipserve.batching.tower import Completed, TowerKind
from clipserve.batching.worker import DeviceWorker
from clipserve.config import BatchingConfig
from clipserve.errors import (
    ImageTooLarge,
    InvalidImage,
    NonFiniteEmbedding,
    NotReady,
    Overloaded,
    with_item_index,
)
from clipserve.metrics import Metrics

if TYPE_CHECKING:  # imports torch: only with --decode gpu
    from clipserve.inference.gpu_decode import DeviceDecoder


class Batcher:
    """Create inside a running event loop; `start()` launches the workers."""

    def __init__(
        self,
        executors: Sequence[Executor],
        config: BatchingConfig,
        metrics: Metrics,
        threads: Sequence[ThreadPoolExecutor | None] | None = None,
        kind: TowerKind = "image",
        decoders: Sequence[DeviceDecoder | None] | None = None,
    ) -> None:
        self.max_batch_size = config.max_batch_size
        self.admission = Admission(config.max_queue_size)
        self.queue = BatchQueue(
            on_expired=metrics.expired_items.labels(kind).inc,
            admitted=lambda: self.admission.used,
        )
        self.workers = [
            DeviceWorker(
                ex,
                self.queue,
                max_batch_size=config.max_batch_size,
                max_delay_s=config.max_queue_delay_ms / 1000,
                pipeline_depth=config.pipeline_depth,
                decoder=decoder,
                metrics=metrics,
                thread=thread,
                on_death=self._on_worker_death,
                kind=kind,
            )
            for ex, thread, decoder in zip(
                executors,
                threads or [None] * len(executors),
                decoders or [None] * len(executors),
                strict=True,
            )
        ]

    def _on_worker_death(self) -> None:
        if not self.alive:  # nothing will ever take what is queued: fail it now, not at timeout
            self.queue.fail_all(NotReady("no executor worker is alive"))

    def start(self) -> None:
        for worker in self.workers:
            worker.start()

    async def stop(self) -> None:
        await asyncio.gather(*(w.stop() for w in self.workers))
        self.queue.fail_all(NotReady("server is shutting down"))

    @property
    def alive(self) -> bool:
        return any(w.alive for w in self.workers)

    @property
    def all_alive(self) -> bool:
        return all(w.alive for w in self.workers)

    def depth(self) -> int:
        return len(self.queue)

    def _drain(self, n: int) -> tuple[float, float, float]:
        """(seconds until the live workers are free, seconds to compute n images after that,
        seconds of one batch of the size they would run), from each worker's measured costs.
        O(workers): nothing here looks at the queue."""
        live = [w for w in self.workers if w.alive]
        measured = [w.cost for w in live if w.cost.ready]
        if not measured or n <= 0:
            return 0.0, 0.0, 0.0
        size = min(self.max_batch_size, math.ceil(n / len(live)))
        # A worker not measured yet is assumed to be as fast as the average measured one.
        default = sum(c.seconds(size) for c in measured) / len(measured)
        batch_s = [w.cost.seconds(size) if w.cost.ready else default for w in live]
        rate = sum(size / s for s in batch_s if s > 0)  # images per second, all workers
        if rate <= 0:
            return 0.0, 0.0, 0.0
        now = time.perf_counter()
        busy = sum(w.remaining_s(now) for w in live) / len(live)
        return busy, n / rate, max(batch_s)

    def estimated_wait_s(self, n: int) -> float:
        """Seconds until n more images would be computed, behind every image admitted before
        them; 0 until a batch has been measured."""
        busy, compute, _ = self._drain(self.admission.used + n)
        return busy + compute

    def admit(self, n: int, deadline: float | None = None) -> Ticket:
        """Reserve room for n images, or raise Overloaded. Call before decoding.

        `deadline` is a `time.perf_counter()` time. A request that would wait behind others
        past it (with one batch's time to spare for noise) is refused now, not computed late.
        """
        if not self.alive:
            raise NotReady("no executor worker is alive")
        if not self.admission.fits(n):
            _, overflow_s, _ = self._drain(self.admission.used + n - self.admission.capacity)
            raise self.admission.full(_retry_after(overflow_s))
        if deadline is not None and (self.admission.used or self._busy()):
            busy, compute, margin = self._drain(self.admission.used + n)
            late_s = time.perf_counter() + busy + compute + margin - deadline
            if late_s > 0:
                raise Overloaded(
                    f"the queue ahead would take {busy + compute:.2f} s, past this request's "
                    "deadline; retry later",
                    _retry_after(late_s),
                )
        return self.admission.admit(n, deadline)

    async def reserve(self, n: int, deadline: float | None = None) -> Ticket:
        """`admit`, as the pipeline awaits it from any tower (the engine's is a round trip)."""
        return self.admit(n, deadline)

    def _busy(self) -> bool:
        return any(w.running is not None for w in self.workers)

    async def run(
        self,
        ticket: Ticket,
        arrays: Sequence[np.ndarray],
        *,
        normalize: bool,
        request_id: str,
        deadline: float | None = None,
    ) -> Completed:
        """Queue the arrays and wait for their embeddings. Cancelling drops unstarted items.

        The ticket stays its caller's: items give back their share as they start, and whoever
        admitted the request (the pipeline; the engine for a front end) releases what is left.

        Items still queued when `deadline` (`time.perf_counter()`; the ticket's by default)
        passes, or too close to it to finish, never reach the executor: this raises
        RequestTimeout. The caller's own timeout ends the wait for items already computing.
        """
        if not self.alive:
            raise NotReady("no executor worker is alive")
        deadline = ticket.deadline if deadline is None else deadline
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        items = [
            WorkItem(a, normalize, request_id, loop.create_future(), ticket, now, deadline)
            for a in arrays
        ]
        await self.queue.put(items)
        try:
            rows = await asyncio.gather(*(item.future for item in items))
        except BaseException as exc:
            for item in items:
                if not item.future.cancel() and not item.future.cancelled():
                    item.future.exception()  # retrieved: asyncio logs none as never retrieved
            self.queue.discard(items)
            if isinstance(exc, ITEM_ERRORS) and len(items) > 1:
                index = next(i for i, it in enumerate(items) if _failed_with(it, exc))
                raise with_item_index(exc, index) from None
            raise
        return Completed(
            np.stack(rows),
            queue_s=max(item.started_at - item.enqueued_at for item in items),
            compute_s=max(item.finished_at - item.started_at for item in items),
        )


# Errors of one item's own input (a NaN row; with --decode gpu, an image the device worker could
# not decode): in a list, they name the item.
ITEM_ERRORS = (NonFiniteEmbedding, InvalidImage, ImageTooLarge)


def _failed_with(item: WorkItem, exc: BaseException) -> bool:
    future = item.future
    return future.done() and not future.cancelled() and future.exception() is exc


def _retry_after(seconds: float) -> int:
    """Retry-After in whole seconds, at least 1."""
    return max(1, math.ceil(seconds))
