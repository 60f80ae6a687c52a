"""The process tree behind `--workers N`: one engine, N front ends, restarts, drain, cleanup.

The supervisor computes nothing. It binds the port once (a taken port is the CLI's one line,
as with one process) and every front end inherits that socket, as gunicorn's and uvicorn's own
workers do: one accept queue, which a front end's death does not take with it (connections
queued there wait for another front end). With `--reuse-port` each front end listens on a socket
of its own beside the one held here: the kernel spreads new connections evenly, but resets those
queued on a dead front end's. The supervisor never listens itself: the first front end whose app
has started does, so a client is refused while the model loads, not kept waiting.

It starts the engine and waits until it has warmed up (a startup error is the CLI's one line
and exit 2), then the front ends. A front end that dies is restarted, its slot file removed and
its metrics files merged (`_forget`); the engine cancels its requests when its control
connection closes. An engine that dies is restarted too; meanwhile every front end answers 503
and its probes fail. SIGTERM (or SIGINT) drains the front ends first, then stops the engine,
then removes the slot files, the socket and the metrics files. A supervisor killed outright
leaves them; the next one to start removes them (`slots.remove_stale`: a dead supervisor's lock
file can be taken).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Barrier
from pathlib import Path
from types import FrameType

from prometheus_client import multiprocess
from prometheus_client.mmap_dict import MmapedDict

from clipserve.config import ServerConfig
from clipserve.engine.heartbeat import (
    BACKOFF_MAX_S,
    YOUNG_S,
    HeartbeatReader,
    LivenessMetrics,
    heartbeat_path,
    hung,
)
from clipserve.engine.messages import EngineReady, ModelCard
from clipserve.engine.slots import (
    hold_lock,
    release_lock,
    remove_segments,
    remove_stale,
    segment_prefix,
    shm_dir,
)
from clipserve.errors import StartupError
from clipserve.http.access import check_access
from clipserve.http.buckets import BucketTable
from clipserve.http.listeners import bind_port, check_tls

log = logging.getLogger("clipserve.supervisor")
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


@dataclass
class Child:
    name: str
    process: BaseProcess
    started: float = field(default_factory=time.monotonic)
    failures: int = 0  # consecutive quick deaths, for the restart backoff
    # When the engine last became ready; None while it loads. A death counts as quick from
    # there: one that died 5 s after a 30 s model load was restarted at once, for ever.
    ready_at: float | None = None
    restart_at: float | None = None
    # An engine restarting: when it must be ready by. Its heartbeat is watched only after.
    ready_by: float | None = None
    cause: str = "exited"  # why it is restarted: "hung" once killed for missing its deadline
    heart: HeartbeatReader | None = None

    def backoff_s(self) -> float:
        return min(BACKOFF_MAX_S, 0.5 * 2.0 ** max(self.failures - 1, 0))

    @property
    def label(self) -> str:
        """The metrics' `process` label: engine, frontend-0, ..."""
        return self.name.replace("front end ", "frontend-")


class Supervisor:
    _liveness: LivenessMetrics | None = None  # set by _monitor: ages, restarts by cause

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.ctx = multiprocessing.get_context("spawn")
        self.pid = os.getpid()
        # Held for life, before any file of ours exists: the next supervisor removes our files
        # only once it can take this lock (slots.remove_stale).
        self._lock = hold_lock(self.pid)
        self.tmp = Path(tempfile.mkdtemp(prefix=segment_prefix(self.pid)))
        self.listener: socket.socket | None = None  # the port, bound once for every front end
        self.grpc_hold: socket.socket | None = None  # --grpc-port, bound while we run
        self.socket_path = str(self.tmp / "engine.sock")
        self.card: ModelCard | None = None  # the engine's, once it is ready
        self.engine: Child | None = None
        self.engine_ready: Connection | None = None
        self.front: list[Child | None] = [None] * config.http.workers
        self.metrics: Path | None = None  # PROMETHEUS_MULTIPROC_DIR, once set up
        self.stopping = False
        self.hangup = False  # SIGHUP: passed on to the front ends (they reload the key file)
        self._own_metrics_dir = MULTIPROC_ENV not in os.environ
        # The rate limits' buckets, one table for every front end (no name a slot file has).
        access = config.access
        limited = access.api_keys is not None or access.rate_limit is not None
        self.buckets = str(shm_dir() / f"{segment_prefix(self.pid)}quota") if limited else None
        # The first front ends' start barrier: its named semaphores (/dev/shm/sem.mp-*) are
        # unlinked once every front end has them open (`_drop_barrier`), so a supervisor killed
        # with its resource tracker leaves none behind.
        self._together: Barrier | None = None

    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, self._on_hangup)
        try:
            stale = remove_stale(shm_dir(), Path(tempfile.gettempdir()), keep=self.tmp)
            if stale:
                log.info("removed what killed supervisors left (pid: files) %s", stale)
            check_access(self.config.access)  # a bad key file: one line, before the model loads
            check_tls(self.config.http)
            self._metrics_dir()
            self._check_port()
            if self.buckets is not None:
                BucketTable.remove(self.buckets)  # left by a killed supervisor of this pid
                BucketTable(self.buckets, create=True).close()
            self._start_engine()
            try:
                self._wait_engine_ready()
            except StartupError:
                if self.stopping:  # SIGTERM while the model loaded: a stop, not a failure
                    log.info("stopped before the engine was ready")
                    return 0
                raise
            self._together = self.ctx.Barrier(len(self.front))
            for index in range(len(self.front)):
                self._start_front(index, self._together)
            http = self.config.http
            engine_pid = self.engine.process.pid if self.engine else 0
            log.info(
                "serving on %s://%s:%d with %d front ends and one engine (pid %d)",
                "https" if http.ssl_certfile else "http",
                http.host,
                http.port,
                len(self.front),
                engine_pid,
            )
            self._monitor()
            return 0
        finally:
            self._shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self.stopping:
            name = signal.Signals(signum).name
            log.info("%s: draining the front ends, then the engine", name)
        self.stopping = True

    def _on_hangup(self, signum: int, frame: FrameType | None) -> None:
        self.hangup = True

    def _metrics_dir(self) -> None:
        """Prometheus multiprocess mode: every process writes its values under one directory,
        emptied at startup; each front end's /metrics sums them."""
        if self._own_metrics_dir:
            self.metrics = self.tmp / "metrics"
            self.metrics.mkdir()
            os.environ[MULTIPROC_ENV] = str(self.metrics)
            return
        self.metrics = Path(os.environ[MULTIPROC_ENV])
        for stale in self.metrics.glob("*.db"):
            stale.unlink()

    def _check_port(self) -> None:
        """Bind the port for every front end, failing at once, as one process would, when it
        is taken. Bound, not listening: the front ends' uvicorn listens, with its backlog,
        once an app has started; until then a client is refused rather than queued. The gRPC
        port is held the same way for life, with SO_REUSEPORT, so each front end's gRPC server
        binds it beside the others (docs/api.md: what that costs when a front end dies)."""
        http = self.config.http
        # --reuse-port: held as the gRPC port is, each front end listening on a socket of its
        # own beside it (http/listeners.py's `beside`).
        self.listener = bind_port(http.host, http.port, "--host/--port", reuse_port=http.reuse_port)
        if http.grpc_port:
            self.grpc_hold = bind_port(http.host, http.grpc_port, "--grpc-port", reuse_port=True)

    def _start_engine(self) -> None:
        from clipserve.engine.service import engine_main

        receive, send = self.ctx.Pipe(duplex=False)
        args = (self.config, self.socket_path, send, self.pid)
        process = self.ctx.Process(target=engine_main, name="clipserve-engine", args=args)
        process.start()
        send.close()
        failures = self.engine.failures if self.engine else 0
        self.engine = Child("engine", process, failures=failures)
        self.engine_ready = receive

    def _wait_engine_ready(self) -> None:
        assert self.engine is not None and self.engine_ready is not None
        deadline = time.monotonic() + self.config.http.engine_start_timeout_s
        while not self.engine_ready.poll(0.2):
            if not self.engine.process.is_alive():
                raise StartupError("the engine process exited while starting (see the log)")
            if time.monotonic() > deadline or self.stopping:
                self.engine.process.kill()  # a hung engine: the next restart starts afresh
                raise StartupError("the engine process did not become ready")
        try:
            message: EngineReady = self.engine_ready.recv()
        except EOFError:  # it died before a word: an unexpected error, its traceback logged
            raise StartupError("the engine process exited while starting (see the log)") from None
        if message[0] == "error":
            raise StartupError(message[1])
        self.card = message[1]
        self.engine.ready_at = time.monotonic()

    def _start_front(self, index: int, together: Barrier | None = None) -> None:
        from clipserve.engine.frontend import frontend_main

        assert self.card is not None and self.listener is not None  # bound, engine ready
        # The socket is pickled as its descriptor, which spawn passes to the child by
        # inheritance (the pass_fds of its fork_exec: multiprocessing.reduction.DupFd under
        # a spawning Popen), at the same number: no resource-sharer thread or SCM_RIGHTS
        # round trip that could fail, and nothing for the child to wait on.
        listener, buckets = self.listener, self.buckets
        args = (
            self.config,
            self.socket_path,
            self.card,
            index,
            self.pid,
            listener,
            together,
            buckets,
        )
        name = f"clipserve-frontend-{index}"
        process = self.ctx.Process(target=frontend_main, name=name, args=args)
        process.start()
        old = self.front[index]
        failures = old.failures if old else 0
        self.front[index] = Child(f"front end {index}", process, failures=failures)

    def _monitor(self) -> None:
        """Every 0.2 s at most: restart what exited, kill what is hung (`_watch`), follow a
        restarting engine to readiness; front ends are restarted once the engine is ready."""
        if self.metrics is not None:
            labels = [c.label for c in (self.engine, *self.front) if c is not None]
            self._liveness = LivenessMetrics(self.metrics, labels)
        try:
            while not self.stopping:
                children = [c for c in (self.engine, *self.front) if c is not None]
                wait([c.process.sentinel for c in children if c.restart_at is None], timeout=0.2)
                if self.hangup:
                    self.hangup = False
                    self._pass_on_hangup()
                now = time.monotonic()
                self._engine_starting(now)
                children = [c for c in (self.engine, *self.front) if c is not None]
                ages = {child.label: self._watch(child, now) for child in children}
                self._drop_barrier()
                if self._liveness is not None:
                    self._liveness.ages(ages)
                if self.engine is not None and self._due(self.engine, now):
                    self._restart_engine()
                # A front end waits while the engine is dead or starting: started against no
                # engine, it would give up (and be restarted) before a slow model has loaded.
                engine = self.engine
                starting = engine is not None and (
                    engine.ready_by is not None or not engine.process.is_alive()
                )
                for index, child in enumerate(self.front):
                    if child is not None and self._due(child, now) and not starting:
                        self._start_front(index)
        finally:
            if self._liveness is not None:
                self._liveness.close()
                self._liveness = None

    def _drop_barrier(self) -> None:
        """Let the start barrier go (its finaliser unlinks the semaphores) once each front end
        has opened it: a front end that stamped its heartbeat has unpickled its arguments, the
        barrier among them; one that exited no longer needs it."""
        if self._together is None:
            return
        for child in self.front:
            if child is None:
                return
            beat = child.heart.read() if child.heart is not None else None
            if beat is None and child.process.is_alive():
                return
        self._together = None

    def _watch(self, child: Child, now: float) -> float:
        """The child's heartbeat age; a child that missed its deadline is logged and killed
        (SIGKILL: a stopped process cannot take SIGTERM), and `_exited` restarts it as it
        would a dead one. Not while it is starting (an engine warming up has its own limit,
        --engine-start-timeout-s), exiting, already killed, or while stopping."""
        pid = child.process.pid
        if child.heart is None and pid is not None:
            child.heart = HeartbeatReader(heartbeat_path(self.tmp, pid))
        beat = child.heart.read() if child.heart is not None else None
        age = now - (beat.at if beat is not None else child.started)
        if self.stopping or child.ready_by is not None or child.cause == "hung":
            return age
        why = hung(beat, now, self.config.http.heartbeat_timeout_s, child.started)
        if why is not None and child.process.is_alive():
            log.error("%s (pid %s) is hung: %s; killing it", child.name, pid, why)
            child.cause = "hung"
            child.process.kill()
        return age

    def _pass_on_hangup(self) -> None:
        """SIGHUP: every front end reloads the key file now (they also notice a change
        themselves within a second; this is for an edit that kept its mtime and size)."""
        pids = [c.process.pid for c in self.front if c is not None and c.process.is_alive()]
        log.info("SIGHUP: front ends reload the key file")
        for pid in pids:
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGHUP)

    def _due(self, child: Child, now: float) -> bool:
        """Whether an exited child's restart is due (not while stopping)."""
        if not self._exited(child, now) or self.stopping:
            return False
        return child.restart_at is not None and now >= child.restart_at

    def _exited(self, child: Child, now: float) -> bool:
        """True once the child has exited; the first time, logs it and schedules its restart."""
        if child.process.is_alive():
            return False
        if child.restart_at is None and not self.stopping:
            up = child.started if child.name != "engine" else child.ready_at
            quick = up is None or now - up < YOUNG_S  # an engine that never got ready: quick
            child.failures = child.failures + 1 if quick else 1
            child.restart_at = now + (child.backoff_s() if quick else 0.0)
            how = "was killed" if child.cause == "hung" else "exited"
            log.error(
                "%s (pid %s) %s with %s; restarting it in %.1f s",
                child.name,
                child.process.pid,
                how,
                child.process.exitcode,
                child.restart_at - now,
            )
            if self._liveness is not None:
                self._liveness.restarted(child.label, child.cause)
            if child.heart is not None:
                child.heart.close(unlink=True)
            if self._together is not None and child.name != "engine":
                # Its replacement gets no barrier: the others go on now, not in 60 s (the
                # barrier itself goes once each has opened it: `_drop_barrier`).
                self._together.abort()
            self._forget(child)
        return True

    def _forget(self, child: Child) -> None:
        """What an exited child leaves: a front end's slot files, and any child's metrics
        files (merged: see `prune_metrics`). Never raises: the supervisor must go on."""
        pid = child.process.pid
        if pid is None:
            return
        if child.name != "engine":
            remove_segments(self.pid, pid)
        if self.metrics is not None:
            try:
                prune_metrics(self.metrics, pid)
            except (OSError, ValueError, RuntimeError) as e:  # a file cut short, a full disk
                log.warning("%s (pid %d): its metrics files not merged: %s", child.name, pid, e)

    def _restart_engine(self) -> None:
        """Start a new engine and return: `_engine_starting` sees it become ready, while
        `_monitor` goes on watching the front ends."""
        self._start_engine()
        assert self.engine is not None
        self.engine.ready_by = time.monotonic() + self.config.http.engine_start_timeout_s

    def _engine_starting(self, now: float) -> None:
        engine, ready = self.engine, self.engine_ready
        if engine is None or engine.ready_by is None or ready is None:
            return
        if not ready.poll():  # neither its word nor, once it died, the pipe's end
            if now > engine.ready_by and engine.cause != "hung":
                limit = self.config.http.engine_start_timeout_s
                log.error("the engine was not ready in %.0f s; killing it", limit)
                engine.cause = "hung"
                engine.process.kill()
            return
        engine.ready_by = None
        try:
            self._wait_engine_ready()  # its word is there: returns or raises at once
        except StartupError as e:
            log.error("the engine did not restart: %s", e)  # it exits: _exited restarts it
            return
        log.info("engine restarted (pid %s); front ends reconnect", engine.process.pid)

    def _shutdown(self) -> None:
        """Front ends first (they drain their requests through the engine), then the engine."""
        self.stopping = True
        if self.listener is not None:
            # The front ends hold the socket until they stop accepting; then it closes, and
            # new clients are refused rather than queued behind nobody.
            self.listener.close()
        if self.grpc_hold is not None:
            self.grpc_hold.close()
        fronts = [c.process for c in self.front if c is not None]
        _terminate(fronts, self.config.http.stop_limit_s)
        if self.engine is not None:
            _terminate([self.engine.process], 30.0)
        remove_segments(self.pid)
        if self.buckets is not None:
            BucketTable.remove(self.buckets)
        if self._own_metrics_dir:
            os.environ.pop(MULTIPROC_ENV, None)
        elif self.metrics is not None:  # the user's directory: emptied, as at startup
            for stale in self.metrics.glob("*.db"):
                stale.unlink(missing_ok=True)
        shutil.rmtree(self.tmp, ignore_errors=True)
        release_lock(self.pid, self._lock)  # last: until here, our files are in use


def _terminate(processes: list[BaseProcess], timeout_s: float) -> None:
    for process in processes:
        if process.is_alive() and process.pid is not None:
            os.kill(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(max(deadline - time.monotonic(), 0.0))
        if process.is_alive():
            log.error("%s did not stop in %.0f s; killing it", process.name, timeout_s)
            process.kill()
            process.join(5.0)


# What a dead process's metrics files become: its counters, histograms and summaries added
# into one file per type, named like a process's (`counter_merged.db`); never a pid.
MERGED = "merged"
ADDITIVE = ("counter", "histogram", "summary")  # a file's values per key sum across processes


def prune_metrics(directory: Path, pid: int) -> None:
    """Prune a dead process's files from the multiprocess directory. Its live gauges go
    (`mark_process_dead`, the client library's own bookkeeping for a dead process), and its
    other gauges too: each of ours describes a living process (a dead engine's cache is gone).
    Its counters, histograms and summaries are added into `<type>_merged.db`, the raw values
    key by key as `MultiProcessCollector.merge(accumulate=False)` sums them, so a total never
    drops (Prometheus would read a reset) and the directory holds one set of files per live
    process, plus the merged ones. The merged file is replaced whole (a scrape reads the old
    or the new), then the dead one removed: a scrape that lands between the two counts the
    dead process twice, for that one scrape."""
    multiprocess.mark_process_dead(pid, str(directory))  # type: ignore[no-untyped-call]
    for path in directory.glob(f"*_{pid}.db"):
        kind = path.name.split("_", 1)[0]
        if kind in ADDITIVE:
            _add_into(directory / f"{kind}_{MERGED}.db", path)
        path.unlink(missing_ok=True)


def _add_into(merged: Path, dead: Path) -> None:
    totals: dict[str, float] = {}
    for path in (merged, dead):
        if path.exists():
            values = MmapedDict.read_all_values_from_file(str(path))  # type: ignore[no-untyped-call]
            for key, value, _timestamp, _position in values:
                totals[key] = totals.get(key, 0.0) + value
    fresh = merged.with_suffix(".new")  # not *.db: no scrape reads it half written
    fresh.unlink(missing_ok=True)
    out = MmapedDict(str(fresh))  # type: ignore[no-untyped-call]
    try:
        for key, value in totals.items():
            out.write_value(key, value, 0.0)  # type: ignore[no-untyped-call]
    finally:
        out.close()  # type: ignore[no-untyped-call]
    os.replace(fresh, merged)


def supervise(config: ServerConfig) -> int:
    return Supervisor(config).run()
