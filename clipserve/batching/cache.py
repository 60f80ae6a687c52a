"""The embedding cache: computed rows by key in an LRU bounded by bytes, and the one flight of
each key being computed, which every request asking for it waits on (single-flight).

Keys are opaque here: front ends make them from what decides an answer (`http/cache_keys.py`:
the item's bytes, the model, its weights, precision, normalisation). One cache serves both
towers of a process (the engine's with --workers N), so they share one byte budget.
Everything runs on the event loop.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from clipserve.batching.queue import WorkItem
from clipserve.batching.tower import TowerKind
from clipserve.config import CacheConfig
from clipserve.metrics import Metrics

# What an entry costs beyond its row's data: the array object (112 B), its 16-byte key as a
# bytes object (49 B) and the ordered dict's slot and link (~100 B), rounded up.
ENTRY_OVERHEAD = 288


class EmbeddingLRU:
    """Rows by key, at most `max_bytes` of them with their overhead; the least recently used
    leaves first."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._rows: OrderedDict[bytes, np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, key: bytes) -> np.ndarray | None:
        row = self._rows.get(key)
        if row is not None:
            self._rows.move_to_end(key)
        return row

    def put(self, key: bytes, row: np.ndarray) -> int:
        """Keep a read-only copy of `row` (never a view into its batch's output, which it
        would keep alive); returns how many entries left to make room."""
        cost = row.nbytes + ENTRY_OVERHEAD
        if cost > self.max_bytes:
            return 0
        old = self._rows.pop(key, None)
        if old is not None:
            self.bytes -= old.nbytes + ENTRY_OVERHEAD
        kept = np.array(row, dtype=np.float32, copy=True)
        kept.flags.writeable = False
        self._rows[key] = kept
        self.bytes += cost
        evicted = 0
        while self.bytes > self.max_bytes:
            _, gone = self._rows.popitem(last=False)
            self.bytes -= gone.nbytes + ENTRY_OVERHEAD
            evicted += 1
        return evicted


@dataclass(eq=False)
class Flight:
    """One item on its way through the queue and a device, for every request waiting on it.
    Its admission place is its own (`item.ticket`), not any one request's: a request that
    leaves does not take the place of an item others still wait for."""

    item: WorkItem
    key: bytes | None = None  # None: an item without a key, waited on by its request alone
    waiters: int = 1


class EmbeddingCache:
    """The LRU and the flights of one process's towers."""

    def __init__(self, max_bytes: int, metrics: Metrics) -> None:
        self.lru = EmbeddingLRU(max_bytes)
        self.metrics = metrics
        self.flights: dict[bytes, Flight] = {}

    def found(self, keys: Sequence[bytes], tower: TowerKind) -> list[np.ndarray | None]:
        """Each key's cached row, or None; counts the hits (a miss is counted where it is
        computed: it may yet join a flight)."""
        rows = [self.lru.get(key) for key in keys]
        hits = sum(row is not None for row in rows)
        if hits:
            self.metrics.cache_hits.labels(tower).inc(hits)
        return rows

    def join(
        self, key: bytes, tower: TowerKind, deadline: float | None, fresh: bool
    ) -> np.ndarray | Flight | None:
        """A cached row, or the flight computing `key` (now waited on once more, until the
        latest of its waiters' deadlines), or None: the caller computes it (`take_off`).
        `fresh` (Cache-Control: no-cache) reads neither."""
        if fresh:
            return None
        row = self.lru.get(key)
        if row is not None:
            self.metrics.cache_hits.labels(tower).inc()
            return row
        flight = self.flights.get(key)
        if flight is None:
            return None
        future = flight.item.future
        if future.done():  # landed this loop iteration; its callback has not run yet
            if future.cancelled() or future.exception() is not None:
                return None  # a failure is never an answer for another request
            self.metrics.cache_merged.labels(tower).inc()
            return np.asarray(future.result())
        flight.waiters += 1
        item = flight.item
        if item.deadline is not None:
            item.deadline = None if deadline is None else max(item.deadline, deadline)
        self.metrics.cache_merged.labels(tower).inc()
        return flight

    def take_off(self, flight: Flight, tower: TowerKind) -> None:
        """`flight` computes its key from now on; its row is kept if it succeeds."""
        assert flight.key is not None
        self.metrics.cache_misses.labels(tower).inc()
        self.flights.setdefault(flight.key, flight)  # a fresh one beside a flight flies alone
        flight.item.future.add_done_callback(lambda future: self._landed(flight, future))

    def abandon(self, flight: Flight) -> None:
        """Nobody waits for `flight` and it never started: no one may join it now."""
        if flight.key is not None and self.flights.get(flight.key) is flight:
            del self.flights[flight.key]

    def _landed(self, flight: Flight, future: asyncio.Future[np.ndarray]) -> None:
        self.abandon(flight)
        if future.cancelled() or future.exception() is not None:  # retrieved: never logged
            return
        assert flight.key is not None
        evicted = self.lru.put(flight.key, future.result())
        if evicted:
            self.metrics.cache_evictions.inc(evicted)
        self.metrics.cache_bytes.set(self.lru.bytes)


def embedding_cache(config: CacheConfig, metrics: Metrics) -> EmbeddingCache | None:
    """The cache --cache-mb asks for; None when it is 0 (off)."""
    return EmbeddingCache(config.cache_mb << 20, metrics) if config.cache_mb else None
