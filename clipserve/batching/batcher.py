"""The dynamic batcher: admission, one shared queue, one supervised worker per executor."""

from __future__ import annotations

import asyncio
import math
import time
from asyncio import Future
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from clipserve.backends.base import Executor
from clipserve.batching.cache import EmbeddingCache, Flight
from clipserve.batching.queue import Admission, BatchQueue, Gathering, Ticket, WorkItem
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
    from clipserve.inference.gpu_decode import BatchDecoder


class Batcher:
    """Create inside a running event loop; `start()` launches the workers."""

    def __init__(
        self,
        executors: Sequence[Executor],
        config: BatchingConfig,
        metrics: Metrics,
        threads: Sequence[ThreadPoolExecutor | None] | None = None,
        kind: TowerKind = "image",
        decoders: Sequence[BatchDecoder | None] | None = None,
        cache: EmbeddingCache | None = None,
        warm_costs: Sequence[Sequence[tuple[int, float]]] | None = None,
    ) -> None:
        """`cache`: the embedding cache keyed runs use; one per process, shared by its
        towers (None: keys are ignored). `warm_costs`: per executor, (batch size, seconds)
        timed after its warm-up, the start of its worker's cost model."""
        self.kind = kind
        self.cache = cache
        self._loop = asyncio.get_running_loop()  # asked for per request, it costs a getpid()
        self.max_batch_size = config.max_batch_size
        self.admission = Admission(config.max_queue_size, "images" if kind == "image" else "texts")
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
        for worker, costs in zip(self.workers, warm_costs or [], strict=False):
            for n, seconds in costs:
                worker.cost.observe(n, seconds)

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
        for worker in self.workers:  # noqa: SIM110 (asked for every request: no generator)
            if worker.alive:
                return True
        return False

    def depth(self) -> int:
        return len(self.queue)

    def admitted(self) -> int:
        """Items holding a place of --max-queue-size: the queue's, and those of requests being
        read or looked up in the cache (one place each), which the queue's depth leaves out."""
        return self.admission.used

    def _drain(self, n: int) -> tuple[float, float, float]:
        """(seconds until the live workers are free, seconds to compute n images after that,
        seconds of one batch of the size they would run), from each worker's measured costs.
        O(workers): nothing here looks at the queue."""
        live = [w for w in self.workers if w.alive]
        if not live or n <= 0:
            return 0.0, 0.0, 0.0
        size = min(self.max_batch_size, math.ceil(n / len(live)))
        # Plain loops, not generators: this runs for every request admitted with a deadline.
        batch_s: list[float] = []
        measured = 0
        for w in live:
            if w.cost.ready:
                batch_s.append(w.cost.seconds(size))
                measured += 1
            else:
                batch_s.append(-1.0)
        if not measured:
            return 0.0, 0.0, 0.0
        if measured < len(batch_s):  # unmeasured: as fast as the average measured one
            known = [s for s in batch_s if s >= 0]
            default = sum(known) / len(known)
            batch_s = [s if s >= 0 else default for s in batch_s]
        rate = 0.0  # images per second, all workers
        for s in batch_s:
            if s > 0:
                rate += size / s
        if rate <= 0:
            return 0.0, 0.0, 0.0
        now = time.perf_counter()
        busy = 0.0
        for w in live:
            busy += w.remaining_s(now)
        return busy / len(live), n / rate, max(batch_s)

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

    async def lookup(self, keys: Sequence[bytes]) -> list[np.ndarray | None]:
        """Each key's cached row, or None (everything None without a cache)."""
        return self.cached(keys)

    def cached(self, keys: Sequence[bytes]) -> list[np.ndarray | None]:
        if self.cache is None:
            return [None] * len(keys)
        return self.cache.found(keys, self.kind)

    async def run(
        self,
        ticket: Ticket,
        arrays: Sequence[np.ndarray],
        *,
        normalize: bool,
        request_id: str,
        deadline: float | None = None,
        keys: Sequence[bytes] | None = None,
        fresh: bool = False,
    ) -> Completed:
        """Queue the arrays and wait for their embeddings (`submit`, then its `Run`'s answer).
        Cancelling drops unstarted items nobody else waits for, and returns at once: an item
        of ours that others joined computes on from our arrays, which its references keep
        alive. So the arrays must not be memory the caller reuses (the engine's slots use
        `submit`, and wait for what `Run.leave` says still reads them)."""
        run = self.submit(
            ticket,
            arrays,
            normalize=normalize,
            request_id=request_id,
            deadline=deadline,
            keys=keys,
            fresh=fresh,
        )
        try:
            if run.gathering.pending:
                await run.gathering.future
        except BaseException as exc:
            run.leave()  # no wait for a batch that still reads our arrays: past a deadline
            located = run.located(exc)
            if located is exc:
                raise
            raise located from None
        return run.completed()

    def submit(
        self,
        ticket: Ticket,
        arrays: Sequence[np.ndarray],
        *,
        normalize: bool,
        request_id: str,
        deadline: float | None = None,
        keys: Sequence[bytes] | None = None,
        fresh: bool = False,
    ) -> Run:
        """Queue the arrays; the `Run` answers once its `future` is done. The engine starts
        its front ends' runs here, with a done callback each: no task per request.

        The ticket stays its caller's: each queued item takes one of its places and gives it
        back as it starts, and whoever admitted the request (the pipeline; the engine for a
        front end) releases what is left. With `keys` (one per array) and a cache, an item
        already cached is answered at once and one already in flight is waited on, neither
        holding a place; `fresh` (Cache-Control: no-cache) computes every item anew, and still
        keeps what it computes.

        Items still queued when `deadline` (`time.perf_counter()`; the ticket's by default)
        passes, or too close to it to finish, never reach the executor: the run fails with
        RequestTimeout. The caller's own timeout ends the wait for items already computing.
        """
        if not self.alive:
            raise NotReady("no executor worker is alive")
        if keys is not None and len(keys) != len(arrays):  # before anything is held
            raise ValueError(f"{len(keys)} cache keys for {len(arrays)} items")
        deadline = ticket.deadline if deadline is None else deadline
        now = time.perf_counter()
        gathering = Gathering(self._loop.create_future(), len(arrays))
        flights: list[Flight] = []  # keyed items this request waits on, its own or joined
        if self.cache is None or keys is None:  # one ticket: each item releases its place
            shared = ticket.split(len(arrays))
            future = gathering.future  # the items answer into their request: no future each
            ours = [
                WorkItem(array, normalize, request_id, future, shared, now, deadline, gathering, i)
                for i, array in enumerate(arrays)
            ]
        else:
            ours = []
            for index, (array, key) in enumerate(zip(arrays, keys, strict=True)):
                source = self.cache.join(key, self.kind, deadline, fresh)
                if isinstance(source, np.ndarray):
                    gathering.landed(index, source)
                    continue
                if source is None:  # its own place: others may come to wait for it too
                    item = WorkItem(
                        array,
                        normalize,
                        request_id,
                        self._loop.create_future(),
                        ticket.split(1),
                        now,
                        deadline,
                        gathering=gathering,
                        index=index,
                    )
                    source = Flight(item, key)
                    self.cache.take_off(source, self.kind)
                    ours.append(item)
                else:
                    source.item.future.add_done_callback(partial(gathering.joined, index))
                flights.append(source)
            ticket.release(len(arrays) - len(ours))  # answered or joined: no place of their own
        run = Run(self, gathering, flights, ours, len(arrays))
        if ours:
            try:
                self.queue.put_nowait(ours)
            except BaseException:
                run.leave()
                raise
        return run

    def _leave(self, flights: Sequence[Flight], ours: Sequence[WorkItem]) -> list[Future[Any]]:
        """A request stops waiting (it failed, timed out or went away). An item nobody waits
        for any more is dropped, started or not. One that others still wait for goes on; if
        its array is this request's (`ours`), which a caller of `submit` may reuse once it
        has left (the engine's slots), it gets a copy, or, already computing, is returned: that
        caller waits until it is done."""
        unstarted: list[WorkItem] = []
        reading: list[Future[Any]] = []
        if not flights:  # no keys: the items share their request's future and one ticket
            if ours:
                ours[0].future.cancel()  # still queued or computing: answered by nobody now
                ours[0].ticket.release_all()  # the places of those not started
            unstarted = [item for item in ours if not item.started_at]
        own = {id(item) for item in ours} if flights else set()
        for flight in flights:
            flight.waiters -= 1
            item = flight.item
            if item.future.done():
                continue
            if flight.waiters == 0:
                _drop(item, unstarted)  # its outcome is never read, nor cached
                if self.cache is not None:
                    self.cache.abandon(flight)
            elif id(item) in own:
                if item.started_at:
                    reading.append(item.future)
                else:
                    item.array = np.array(item.array)
        self.queue.discard(unstarted)
        return reading


def _timings(items: Sequence[WorkItem]) -> tuple[float, float]:
    """The longest queue wait and the longest compute of a request's items (0 without any)."""
    if not items:
        return 0.0, 0.0
    queue_s = compute_s = -math.inf
    for item in items:  # comparisons, not max(): two calls per item cost more than the rest
        started = item.started_at
        waited = started - item.enqueued_at
        if waited > queue_s:
            queue_s = waited
        computed = item.finished_at - started
        if computed > compute_s:
            compute_s = computed
    return queue_s, compute_s


def _drop(item: WorkItem, unstarted: list[WorkItem]) -> None:
    item.future.cancel()
    if not item.started_at:
        item.ticket.release_all()
        unstarted.append(item)


class Run:
    """One request's items in a tower, from `Batcher.submit`: done when `future` is (at once
    when the cache held every item)."""

    __slots__ = ("batcher", "flights", "gathering", "n", "ours")

    def __init__(
        self,
        batcher: Batcher,
        gathering: Gathering,
        flights: list[Flight],
        ours: list[WorkItem],
        n: int,
    ) -> None:
        self.batcher = batcher
        self.gathering = gathering
        self.flights = flights
        self.ours = ours
        self.n = n

    @property
    def future(self) -> Future[None]:
        return self.gathering.future

    def completed(self) -> Completed:
        """The embeddings, once `future` has its result."""
        rows = self.gathering.rows
        flights = self.flights
        queue_s, compute_s = _timings([f.item for f in flights] if flights else self.ours)
        return Completed(
            rows if rows is not None else np.empty((0, 0), np.float32), queue_s, compute_s
        )

    def leave(self) -> list[Future[Any]]:
        """Stop waiting (failed, timed out, cancelled); the futures of items still reading
        this request's arrays, which must outlive them (see `Batcher._leave`). The run's own
        future is cancelled: an item it joined may still fail, and nobody reads it now."""
        reading = self.batcher._leave(self.flights, self.ours)
        self.gathering.future.cancel()
        return reading

    def located(self, exc: BaseException) -> BaseException:
        """`exc` as the request's error: an item's own error names its index in a list."""
        if isinstance(exc, ITEM_ERRORS) and self.n > 1 and self.gathering.failed >= 0:
            return with_item_index(exc, self.gathering.failed)
        return exc


# Errors of one item's own input (a NaN row; with --decode gpu, an image the device worker could
# not decode): in a list, they name the item.
ITEM_ERRORS = (NonFiniteEmbedding, InvalidImage, ImageTooLarge)


def _retry_after(seconds: float) -> int:
    """Retry-After in whole seconds, at least 1."""
    return max(1, math.ceil(seconds))
