"""Liveness by heartbeat (`--workers N`): every child proves progress, the supervisor watches.

Each child (the engine, every front end) has a file of one record, `heartbeat-<pid>` in the
supervisor's temp directory, mapped into memory: a task on its event loop stamps it every
`BEAT_INTERVAL_S` with `time.monotonic()` (CLOCK_MONOTONIC, one clock for every process on the
host, which does not jump with the wall clock). The engine's stamp also names its device worker
whose batch in flight is due soonest, and when: a worker mid-batch past its due time is hung
although the loop is fine; an idle worker is never due, however long its queue stays empty.

A file rather than the pipes: the supervisor reads the last stamp whenever it likes, from a
process stopped or spinning as well as from a healthy one, with no reader that must keep up and
no buffer that fills while it looks away; writing costs a `struct.pack_into` into a page of
memory twice a second. The supervisor (`supervisor._monitor`) kills a child whose stamp is older
than `--heartbeat-timeout-s`, or whose worker is past due, and restarts it as a dead one.

The supervisor also writes two metrics straight into the multiprocess directory under its own
name (`LivenessMetrics`): every front end's /metrics sums that directory's files, and the
supervisor, which serves nothing, is the one process that knows every child's age and restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import struct
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from prometheus_client.mmap_dict import MmapedDict, mmap_key

from clipserve.batching.cost import CostModel

BEAT_INTERVAL_S = 0.5
BACKOFF_MAX_S = 10.0  # the longest wait before restarting a child that keeps dying young
YOUNG_S = 10.0  # a child that dies younger than this (since it came up) is restarted with backoff
# A front end stamps first once its app starts: after importing torch and open_clip and waiting
# for the others (front end start-up, up to a minute) and for the engine's card (another).
FIRST_BEAT_S = 120.0
_RECORD = struct.Struct("<ddd48s")  # beat, busy since, due, which worker (UTF-8, padded)


def heartbeat_path(directory: Path, pid: int) -> Path:
    return directory / f"heartbeat-{pid}"


def restart_deadline_s(timeout_s: float) -> float:
    """How long a front end may hear nothing from a connected engine before it fails its
    liveness too: the supervisor kills a silent engine at `timeout_s` (the connection then
    closes, and the front end answers 503 until a new one is up); silence that lasts twice as
    long means nobody is acting on it, and only restarting the whole server helps."""
    return 2.0 * timeout_s


def replace_deadline_s(timeout_s: float, start_s: float) -> float:
    """How long a front end may be without its engine (gone, or not yet back) before it fails
    its liveness: the supervisor sees a death at once, waits its backoff and gives the new
    engine `start_s` (--engine-start-timeout-s) to load and warm up. Until then readiness alone
    fails: a pod restarted meanwhile would only load the same model again."""
    return BACKOFF_MAX_S + start_s + timeout_s


@dataclass(frozen=True)
class Busy:
    """The device worker whose batch in flight is due soonest (times: `time.monotonic()`)."""

    what: str  # "image:cuda:0"
    since: float  # when its oldest batch in flight was taken
    due: float  # by when that batch should be done, with the margin


@dataclass(frozen=True)
class Beat:
    at: float  # the last stamp, `time.monotonic()`
    busy: Busy | None


class RunningWorker(Protocol):
    """What the heartbeat reads of a `DeviceWorker`."""

    @property
    def kind(self) -> str: ...

    @property
    def device(self) -> str: ...

    @property
    def depth(self) -> int: ...

    @property
    def cost(self) -> CostModel: ...

    @property
    def running(self) -> tuple[float, int] | None: ...


def busiest(workers: Iterable[RunningWorker], margin_s: float, unmeasured_s: float) -> Busy | None:
    """The worker whose batch in flight is due soonest; None when none is computing. A batch is
    due `margin_s` after its expected time: the worker's cost model for its size (from measured
    batches), or `unmeasured_s` before any has been measured, plus, where batches overlap on
    the device (pipeline depth above 1), the one ahead of it that it may have waited behind."""
    now, perf = time.monotonic(), time.perf_counter()
    soonest: Busy | None = None
    for worker in workers:
        running = worker.running
        if running is None:
            continue
        taken, size = running  # time.perf_counter(): not shared across processes
        since = now - (perf - taken)
        expected = worker.cost.seconds(size) if worker.cost.ready else unmeasured_s
        due = since + (2 if worker.depth > 1 else 1) * expected + margin_s
        if soonest is None or due < soonest.due:
            soonest = Busy(f"{worker.kind}:{worker.device}", since, due)
    return soonest


def hung(beat: Beat | None, now: float, timeout_s: float, started: float) -> str | None:
    """Why a child is hung, or None. No stamp yet: it is given `FIRST_BEAT_S` from `started`."""
    if beat is None:
        silent = now - started
        return f"no heartbeat {silent:.1f} s after its start" if silent > FIRST_BEAT_S else None
    silent = now - beat.at
    if silent > timeout_s:
        return f"event loop silent for {silent:.1f} s"
    if beat.busy is not None and now > beat.busy.due:
        return f"{beat.busy.what} worker mid-batch for {now - beat.busy.since:.1f} s"
    return None


class HeartbeatWriter:
    """A child's side: create its file and stamp it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, _RECORD.size)
            self._map = mmap.mmap(fd, _RECORD.size)
        finally:
            os.close(fd)
        self.stamp()

    def stamp(self, busy: Busy | None = None) -> None:
        what = busy.what.encode()[:48] if busy else b""
        since, due = (busy.since, busy.due) if busy else (0.0, 0.0)
        _RECORD.pack_into(self._map, 0, time.monotonic(), since, due, what)

    def close(self, unlink: bool = True) -> None:
        self._map.close()
        if unlink:
            self.path.unlink(missing_ok=True)


async def keep_beating(
    writer: HeartbeatWriter,
    busy: Callable[[], Busy | None] = lambda: None,
    interval_s: float = BEAT_INTERVAL_S,
) -> None:
    """Stamp every `interval_s` until cancelled: on the event loop, so a stopped or blocked
    loop stops the stamps."""
    while True:
        writer.stamp(busy())
        await asyncio.sleep(interval_s)


class HeartbeatReader:
    """The supervisor's side of one child's file, mapped once it exists."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._map: mmap.mmap | None = None

    def read(self) -> Beat | None:
        """The last stamp; None before the child has made its file."""
        if self._map is None:
            try:
                fd = os.open(self.path, os.O_RDONLY)
            except FileNotFoundError:
                return None
            try:
                if os.fstat(fd).st_size < _RECORD.size:  # created, not yet sized
                    return None
                self._map = mmap.mmap(fd, _RECORD.size, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
        # The record is written without a lock: read it until two reads agree, so a read
        # never mixes two stamps.
        raw = self._map[: _RECORD.size]
        for _ in range(3):
            again = self._map[: _RECORD.size]
            if again == raw:
                break
            raw = again
        at, since, due, what = _RECORD.unpack(raw)
        if not at:  # sized, not yet stamped
            return None
        busy = Busy(what.rstrip(b"\0").decode(errors="replace"), since, due) if due else None
        return Beat(at, busy)

    def age(self, now: float, started: float) -> float:
        """Seconds since the child last proved progress (since its start, before a stamp)."""
        beat = self.read()
        return now - (beat.at if beat is not None else started)

    def close(self, unlink: bool = False) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        if unlink:
            self.path.unlink(missing_ok=True)


AGE = "clipserve_heartbeat_age_seconds"
AGE_HELP = "Seconds since the process last proved progress (--workers N; its start, before)"
RESTARTS = "clipserve_restarts"
RESTARTS_HELP = "Processes restarted by the supervisor: exited, or hung (missed its heartbeat)"
CAUSES = ("exited", "hung")


class LivenessMetrics:
    """The supervisor's metrics, written into the multiprocess directory as files of the
    client library's own format, as a process of its would write them: a gauge file in `max`
    mode (its one writer's values, without a pid label) and a counter file. Named `supervisor`,
    not by pid: `prune_metrics` merges and removes dead children's files by their pid, and a
    new supervisor empties the directory at its start."""

    def __init__(self, directory: Path, processes: Sequence[str] = ()) -> None:
        self._ages = MmapedDict(str(directory / "gauge_max_supervisor.db"))  # type: ignore[no-untyped-call]
        self._counts = MmapedDict(str(directory / "counter_supervisor.db"))  # type: ignore[no-untyped-call]
        self._restarts: dict[tuple[str, str], float] = {}
        # Every series at 0 from the start: `increase()` counts a first restart only from a 0.
        for process in processes:
            for cause in CAUSES:
                self._write(process, cause, 0.0)

    def ages(self, ages: Mapping[str, float]) -> None:
        for process, age in ages.items():
            key = mmap_key(AGE, AGE, ["process"], [process], AGE_HELP)
            self._ages.write_value(key, round(age, 3), 0.0)  # type: ignore[no-untyped-call]

    def restarted(self, process: str, cause: str) -> None:
        self._write(process, cause, self._restarts.get((process, cause), 0.0) + 1)

    def _write(self, process: str, cause: str, count: float) -> None:
        self._restarts[process, cause] = count
        labels = ["process", "cause"]
        key = mmap_key(RESTARTS, RESTARTS + "_total", labels, [process, cause], RESTARTS_HELP)
        self._counts.write_value(key, count, 0.0)  # type: ignore[no-untyped-call]

    def close(self) -> None:
        for mapped in (self._ages, self._counts):
            with contextlib.suppress(OSError, ValueError):
                mapped.close()  # type: ignore[no-untyped-call]
