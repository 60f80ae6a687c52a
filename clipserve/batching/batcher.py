"""The dynamic batcher: admission, one shared queue, one supervised worker per executor."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from clipserve.backends.base import Executor
from clipserve.batching.queue import Admission, BatchQueue, Ticket, WorkItem
from clipserve.batching.worker import DeviceWorker
from clipserve.config import BatchingConfig
from clipserve.errors import NotReady
from clipserve.metrics import Metrics


@dataclass
class Completed:
    """Embeddings of one request, in order, and when its items queued and computed."""

    embeddings: np.ndarray  # (N, D) float32
    queue_s: float
    compute_s: float


class Batcher:
    """Create inside a running event loop; `start()` launches the workers."""

    def __init__(
        self,
        executors: Sequence[Executor],
        config: BatchingConfig,
        metrics: Metrics,
        threads: Sequence[ThreadPoolExecutor | None] | None = None,
        kind: str = "image",
    ) -> None:
        self.admission = Admission(config.max_queue_size)
        self.queue = BatchQueue()
        self.workers = [
            DeviceWorker(
                ex,
                self.queue,
                max_batch_size=config.max_batch_size,
                max_delay_s=config.max_queue_delay_ms / 1000,
                metrics=metrics,
                thread=thread,
                on_death=self._on_worker_death,
                kind=kind,
            )
            for ex, thread in zip(executors, threads or [None] * len(executors), strict=True)
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

    def admit(self, n: int) -> Ticket:
        """Reserve room for n images, or raise Overloaded. Call before decoding."""
        if not self.alive:
            raise NotReady("no executor worker is alive")
        return self.admission.admit(n)

    async def run(
        self, ticket: Ticket, arrays: Sequence[np.ndarray], *, normalize: bool, request_id: str
    ) -> Completed:
        """Queue the arrays and wait for their embeddings. Cancelling drops unstarted items."""
        if not self.alive:
            raise NotReady("no executor worker is alive")
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        items = [
            WorkItem(a, normalize, request_id, loop.create_future(), ticket, now) for a in arrays
        ]
        await self.queue.put(items)
        try:
            rows = await asyncio.gather(*(item.future for item in items))
        except BaseException:
            for item in items:
                item.future.cancel()
            self.queue.discard(items)
            raise
        finally:
            ticket.release_all()
        return Completed(
            np.stack(rows),
            queue_s=max(item.started_at - item.enqueued_at for item in items),
            compute_s=max(item.finished_at - item.started_at for item in items),
        )
