"""One worker per device: takes batches from the shared queue and keeps up to `depth` of them in
flight on its device.

Two coroutines share the work. The feeder takes a batch as soon as fewer than `depth` are in
flight and hands it to the device thread without waiting; that thread launches it and passes the
wait to a completion thread, which answers the loop once per batch (three thread crossings a
batch). The finisher answers the batches' items in launch order. So batch k+1 is taken,
assembled and copied while batch k computes. An executor without an asynchronous side (the
CPU) computes the whole batch on the device thread, one batch at a time: depth 1, the
synchronous path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from clipserve.backends.base import (
    AsyncExecutor,
    AsyncPixelExecutor,
    Executor,
    PixelExecutor,
    as_async,
    launches_pixels,
    takes_pixels,
)
from clipserve.backends.device import select_device
from clipserve.batching.compute import (
    LOST,
    UNANSWERED,
    Outcome,
    check_shape,
    compute,
    finite,
    rows_of,
)
from clipserve.batching.cost import CostModel
from clipserve.batching.on_device import compute_pixels
from clipserve.batching.queue import BatchQueue, WorkItem, is_encoded, resolve
from clipserve.batching.tower import TowerKind
from clipserve.errors import ClipserveError, ExecutorFailed, ExecutorFatal, NotReady
from clipserve.metrics import Metrics

if TYPE_CHECKING:  # imports torch: only with --decode gpu
    from clipserve.inference.gpu_decode import BatchDecoder, DecodedBatch

log = logging.getLogger(__name__)


def feeding(
    executor: Executor, pipeline_depth: int, decoder_device: str | None
) -> tuple[AsyncExecutor | None, PixelExecutor | None, AsyncPixelExecutor | None]:
    """How a worker feeds `executor` (the startup self-check feeds its canaries the same way):
    its asynchronous side where batches are pipelined (None: `run`), and with GPU decode on
    `decoder_device` the side that takes its crops there and that side's `launch_pixels`
    (None: the crops come through the host)."""
    asynchronous = as_async(executor) if pipeline_depth > 1 else None
    # An executor on the decoder's device takes its crops as they are: no host round trip.
    pixels = takes_pixels(executor, decoder_device) if decoder_device else None
    launching = launches_pixels(pixels) if pixels else None
    if asynchronous is not None and launching is None:
        pixels = None  # it launches host arrays only: crops come through the host
    return asynchronous, pixels, launching


@dataclass(eq=False)
class _Batch:
    """A batch taken from the queue and not yet answered."""

    items: list[WorkItem]
    taken_at: float
    mask: np.ndarray  # which rows to L2-normalise
    launched_at: float = 0.0  # set on the device thread
    error: Exception | None = None  # launching or waiting failed: bisect it synchronously
    outcome: Outcome | None = None  # computed synchronously already
    # GPU-decoded crops still on the executor's device (`PixelExecutor`); the items' arrays
    # are then their JPEG bytes still.
    decoded: DecodedBatch | None = None
    # Launched batches: (rows, the finite block or None, when they were back, None) or
    # (None, None, 0, the error), set once
    # per batch from the thread that finished with it.
    landed: asyncio.Future[_Landed] | None = None


_Landed = tuple[
    list[np.ndarray | ClipserveError] | None, np.ndarray | None, float, Exception | None
]
_T = TypeVar("_T")


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
        kind: TowerKind = "image",
        pipeline_depth: int = 1,
        decoder: BatchDecoder | None = None,
    ) -> None:
        """`pipeline_depth` batches may be in flight at once where the executor is asynchronous
        (`as_async`); a synchronous executor always runs one at a time."""
        self.kind = kind
        self.executor = executor
        # --decode gpu: turns a batch of JPEG bytes into crops on this worker's device thread,
        # just before the forward pass.
        self.decoder = decoder
        self.device = executor.info.device
        self.queue = queue
        self.max_batch_size = max_batch_size
        self.max_delay_s = max_delay_s
        self.metrics = metrics
        self.on_death = on_death
        self.cost = CostModel()  # device time per batch, learned from this worker's clean batches
        self.asynchronous, self.pixels, self.launches_pixels = feeding(
            executor, pipeline_depth, str(decoder.device) if decoder else None
        )
        self.depth = pipeline_depth if self.asynchronous is not None else 1
        self._inflight: deque[_Batch] = deque()  # taken, not yet answered, in launch order
        self._last_done = 0.0  # time.perf_counter() when the device last finished a batch
        # The executor is only ever called from one thread: the runtime's thread that built it,
        # or a dedicated one made here (and shut down by stop()). Waiting for launched batches
        # happens on a second thread, bound to the same device, so launching never waits.
        self._owns_thread = thread is None
        self._thread = thread or ThreadPoolExecutor(
            1, thread_name_prefix=f"clipserve-{self.device}"
        )
        # Launched batches nobody will wait for (the waiter stopped first): held, not waited
        # for (a batch that never finishes would hang the stop), so their memory is not
        # reused under them; at most the batches launched while stopping.
        self._abandoned: list[object] = []
        self._waiter = (
            ThreadPoolExecutor(
                1,
                thread_name_prefix=f"clipserve-{self.device}-wait",
                initializer=select_device,
                initargs=(self.device,),
            )
            if self.asynchronous is not None
            else None
        )
        self._task: asyncio.Task[None] | None = None
        self.error: str | None = None

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def running(self) -> tuple[float, int] | None:
        """(taken at, size) of the oldest batch in flight; None when idle."""
        if not self._inflight:
            return None
        oldest = self._inflight[0]
        return oldest.taken_at, len(oldest.items)

    @property
    def in_flight(self) -> int:
        """Images taken from the queue and not yet answered."""
        return sum(len(batch.items) for batch in self._inflight)

    def remaining_s(self, now: float) -> float:
        """Estimated seconds until every batch in flight is done; 0 when idle. The device runs
        them one after another, each for its device time, from when it was taken or when the
        one before it ends, whichever is later."""
        end = self._last_done
        for batch in self._inflight:
            end = max(end, batch.taken_at) + self.cost.seconds(len(batch.items))
        return max(end - now, 0.0)

    def _batch_seconds(self, n: int) -> float:
        """When a batch of n taken now would finish: after the batches ahead of it."""
        return self.remaining_s(time.perf_counter()) + self.cost.seconds(n)

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
        if self._waiter is not None:  # it may still be waiting on a batch nobody needs now
            self._waiter.shutdown(wait=False, cancel_futures=True)
        if self._owns_thread:
            self._thread.shutdown(wait=True)

    async def _loop(self) -> None:
        slots = asyncio.Semaphore(self.depth)
        launched: asyncio.Queue[_Batch] = asyncio.Queue()
        tasks = (
            asyncio.create_task(self._feed(slots, launched), name=f"feed-{self.device}"),
            asyncio.create_task(self._finish(slots, launched), name=f"finish-{self.device}"),
        )
        why = NotReady("server is shutting down")
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # neither returns: raise what ended it
            raise RuntimeError("device worker task ended")  # pragma: no cover
        except ExecutorFatal:
            why = NotReady(LOST)
            raise
        except Exception:
            why = NotReady("the device worker stopped before this item was computed; retry")
            raise
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._abandon(why)

    def _abandon(self, error: ClipserveError) -> None:
        """Answer every item still in flight: stop() or a lost device must not strand them."""
        while self._inflight:
            for item in self._inflight.popleft().items:
                resolve(item, error)

    async def _feed(self, slots: asyncio.Semaphore, launched: asyncio.Queue[_Batch]) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await slots.acquire()
            items = await self.queue.take(
                self.max_batch_size, self.max_delay_s, self._batch_seconds
            )
            batch = self._take(items)
            if self.decoder is not None and is_encoded(items[0].array):
                batch.outcome = await self._decode(batch)
                if batch.outcome is not None:  # the decoder itself failed: answer all
                    launched.put_nowait(batch)
                    continue
                if not batch.items:  # every image failed to decode: answered already
                    self._inflight.remove(batch)
                    slots.release()
                    continue
            if self.asynchronous is None:
                batch.outcome = await self._compute_on_thread(batch, None)
            else:  # not awaited: the device thread hands it to the completion thread, which
                # answers the loop once (`_land`); the next batch is taken meanwhile
                batch.landed = loop.create_future()
                try:
                    self._thread.submit(self._launch, batch, loop)
                except Exception as exc:  # the thread is shut down
                    batch.error = exc
            launched.put_nowait(batch)

    def _take(self, items: list[WorkItem]) -> _Batch:
        started = time.perf_counter()
        ticket, places = items[0].ticket, 0  # a request's items share one: release in runs
        for item in items:
            item.started_at = started
            if item.ticket is not ticket:
                ticket.release(places)
                ticket, places = item.ticket, 0
            places += 1
        ticket.release(places)
        batch = _Batch(items, started, np.array([item.normalize for item in items]))
        self._inflight.append(batch)
        return batch

    async def _decode(self, batch: _Batch) -> Outcome | None:
        """JPEG bytes → crops on the device thread; an image that fails is answered with its
        own error (the rest of the batch goes on), and leaves the batch."""
        loop = asyncio.get_running_loop()
        encoded = [item.array.tobytes() for item in batch.items]
        try:
            decoded, crops = await loop.run_in_executor(self._thread, self._decoded, encoded)
        except ExecutorFatal as exc:  # the device is gone: as a failed forward pass would be
            return Outcome([NotReady(LOST) for _ in batch.items], fatal=exc)
        except Exception as exc:
            return Outcome([ExecutorFailed("internal error") for _ in batch.items], errors=[exc])
        for index, error in decoded.errors.items():
            resolve(batch.items[index], error)
        ok = decoded.ok
        if crops is None:  # on the executor's device: handed over as it is
            batch.decoded = decoded
        else:
            for row, index in enumerate(ok):
                batch.items[index].array = crops[row]
        batch.items = [batch.items[i] for i in ok]
        batch.mask = batch.mask[ok]
        return None

    def _decoded(self, encoded: list[bytes]) -> tuple[DecodedBatch, np.ndarray | None]:
        """The decoded batch, and its crops on the host where the executor cannot take them
        from the decoder's device (~150 KB each way per image)."""
        from clipserve.inference.gpu_decode import crops_numpy

        assert self.decoder is not None
        decoded = self.decoder.decode(encoded)
        if self.pixels is not None:
            return decoded, None
        return decoded, crops_numpy(decoded)

    def _launch(self, batch: _Batch, loop: asyncio.AbstractEventLoop) -> None:
        """On the device thread: queue the batch on the device, and its wait on the completion
        thread. A failure (out of memory, for one) is answered to the loop at once."""
        assert self.asynchronous is not None and self._waiter is not None
        handle: object = None
        try:
            if batch.decoded is not None:
                assert self.launches_pixels is not None
                handle = self.launches_pixels.launch_pixels(batch.decoded.pixels, batch.mask)
            else:
                handle = self.asynchronous.launch([item.array for item in batch.items], batch.mask)
            batch.launched_at = time.perf_counter()
            self._waiter.submit(self._wait, batch, handle, loop)
        except Exception as exc:
            if handle is not None:  # launched, its wait not queued (stopping): its staging
                self._abandoned.append(handle)  # stays allocated while it may still compute
            _land(loop, batch, (None, None, 0.0, exc))

    def _wait(self, batch: _Batch, handle: object, loop: asyncio.AbstractEventLoop) -> None:
        """On the completion thread: the batch's rows (split here, off the loop), and when
        they were back, answered to the loop in one call."""
        assert self.asynchronous is not None
        try:
            out = self.asynchronous.wait(handle)
            done = time.perf_counter()
            check_shape(out, len(batch.items))
            block = np.asarray(out, dtype=np.float32)
            rows = rows_of(block)
            landed: _Landed = (rows, block if finite(rows) else None, done, None)
        except Exception as exc:
            landed = (None, None, 0.0, exc)
        _land(loop, batch, landed)

    async def _finish(self, slots: asyncio.Semaphore, launched: asyncio.Queue[_Batch]) -> None:
        while True:
            batch = await launched.get()
            outcome = batch.outcome or await self._collect(batch)
            self._settle(batch, outcome)
            self._inflight.remove(batch)
            if outcome.fatal is not None:  # before the slot is free: nothing more is taken
                raise outcome.fatal  # ends this worker; /readyz reports it
            slots.release()

    async def _collect(self, batch: _Batch) -> Outcome:
        """The rows of a launched batch; a batch that failed is bisected through `run`."""
        if batch.error is None:
            assert batch.landed is not None
            rows, block, done, batch.error = await batch.landed
            if rows is not None:
                # Device time, not latency: the batch could start only once launched and once
                # the batch before it was done. Throughput per batch is what admission needs.
                device_s = done - max(batch.launched_at, self._last_done)
                self._last_done = done
                return Outcome(rows, device_s=device_s, block=block)
        return await self._compute_on_thread(batch, batch.error)

    async def _compute_on_thread(self, batch: _Batch, failed: Exception | None) -> Outcome:
        try:
            if batch.decoded is not None:
                assert self.pixels is not None
                outcome = await _on_thread(
                    self._thread, compute_pixels, self.pixels, batch.decoded, batch.mask, failed
                )
            else:
                arrays = [item.array for item in batch.items]
                outcome = await _on_thread(
                    self._thread, compute, self.executor, arrays, batch.mask, failed
                )
        except Exception as exc:  # not from the executor (the thread pool itself): fail all
            return Outcome([ExecutorFailed("internal error") for _ in batch.items], errors=[exc])
        self._last_done = time.perf_counter()
        return outcome

    def _settle(self, batch: _Batch, outcome: Outcome) -> None:
        """Metrics, the cost model and every item's answer, on the loop."""
        finished = time.perf_counter()
        size = len(batch.items)
        if self.kind == "image":
            self.metrics.device_busy.labels(self.device).inc(max(outcome.device_s, 0.0))
        if outcome.clean:
            self.cost.observe(size, outcome.device_s)
            self.metrics.observe_batch(self.device, size, outcome.device_s, self.kind)
        else:
            computed = sum(1 for row in outcome.rows if isinstance(row, np.ndarray))
            self.metrics.count_items(computed, self.kind)
            self.metrics.batch_retries.labels(self.device).inc(outcome.retries)
            self._log_failure(batch.items, outcome)
        if outcome.block is None:
            bad = outcome.non_finite()
            if bad:
                self.metrics.non_finite.labels(self.kind).inc(bad)
            for item, row in zip(batch.items, outcome.rows, strict=True):
                item.finished_at = finished
                resolve(item, row)
        else:
            _answer_block(batch.items, outcome.block, outcome.rows, finished)

    def _log_failure(self, batch: list[WorkItem], outcome: Outcome) -> None:
        if not outcome.errors and outcome.fatal is None:
            return  # bisected, yet every part ran: a transient failure
        self.metrics.batch_failures.labels(self.device).inc()
        rows = zip(batch, outcome.rows, strict=True)
        failed = [item.request_id for item, row in rows if isinstance(row, UNANSWERED)]
        log.error(
            "%s on %s failed %d of a batch of %d after %d retries; request ids: %s",
            "device lost" if outcome.fatal else "executor error",
            self.device,
            len(failed),
            len(batch),
            outcome.retries,
            ", ".join(sorted(set(failed))),
            exc_info=outcome.fatal or outcome.errors[0],
        )


def _answer_block(
    items: list[WorkItem],
    block: np.ndarray,
    rows: list[np.ndarray | ClipserveError],
    finished: float,
) -> None:
    """Answer a batch whose rows are all in `block`: each run of one request's items in order
    (a request's items are queued together) in one slice, not one call per item."""
    i, n = 0, len(items)
    while i < n:
        item = items[i]
        item.finished_at = finished
        gathering = item.gathering
        j = i + 1
        if gathering is None or item.future is not gathering.future:  # keyed: its own future
            resolve(item, rows[i])
        else:
            first = item.index - i
            while j < n:
                other = items[j]
                if other.gathering is not gathering or other.index != first + j:
                    break
                other.finished_at = finished
                j += 1
            gathering.landed_block(item.index, block[i:j])
        i = j


def _land(loop: asyncio.AbstractEventLoop, batch: _Batch, landed: _Landed) -> None:
    """From a worker thread: answer the batch's future on the loop (one wake-up per batch)."""
    assert batch.landed is not None
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
        loop.call_soon_threadsafe(_settle_future, batch.landed, landed)


def _settle_future(future: asyncio.Future[_T], value: _T) -> None:
    if not future.done():  # cancelled: the worker stopped
        future.set_result(value)


def _on_thread(
    pool: ThreadPoolExecutor, fn: Callable[..., _T], *args: object
) -> asyncio.Future[_T]:
    """`fn(*args)` on `pool`, its result or error set on the loop in one call from the thread:
    `run_in_executor` without a concurrent future chained to this one."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[_T] = loop.create_future()

    def call() -> None:
        try:
            result = fn(*args)
        except Exception as exc:
            setter: Callable[[], None] = partial(_fail_future, future, exc)
        else:
            setter = partial(_settle_future, future, result)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(setter)

    pool.submit(call)
    return future


def _fail_future(future: asyncio.Future[Any], exc: Exception) -> None:
    if not future.done():
        future.set_exception(exc)
