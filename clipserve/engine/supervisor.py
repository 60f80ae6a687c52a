"""The process tree behind `--workers N`: one engine, N front ends, restarts, drain, cleanup.

The supervisor computes nothing and holds no sockets a client could reach. It starts the engine
and waits until it has warmed up (a startup error is the CLI's one line and exit 2), then the
front ends, each binding the port with SO_REUSEPORT so the kernel spreads connections over
them. A front end that dies is restarted and its slot file removed; the engine cancels its
requests when its control connection closes. An engine that dies is restarted too; meanwhile
every front end answers 503 and its probes fail. SIGTERM (or SIGINT) drains the front ends
first, then stops the engine, then removes the slot files, the socket and the metrics files.
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

from clipserve.config import ServerConfig
from clipserve.engine.messages import EngineReady, ModelCard
from clipserve.engine.slots import remove_segments, segment_prefix, shm_dir
from clipserve.errors import StartupError
from clipserve.http.access import check_access
from clipserve.http.buckets import BucketTable
from clipserve.http.server import check_tls

log = logging.getLogger("clipserve.supervisor")
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
ENGINE_START_TIMEOUT_S = 600.0  # loading and warming up a model (a TensorRT build included)
BACKOFF_MAX_S = 10.0


@dataclass
class Child:
    name: str
    process: BaseProcess
    started: float = field(default_factory=time.monotonic)
    failures: int = 0  # consecutive quick deaths, for the restart backoff
    restart_at: float | None = None

    def backoff_s(self) -> float:
        return min(BACKOFF_MAX_S, 0.5 * 2.0 ** max(self.failures - 1, 0))


class Supervisor:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.ctx = multiprocessing.get_context("spawn")
        self.pid = os.getpid()
        self.tmp = Path(tempfile.mkdtemp(prefix="clipserve-"))
        self.socket_path = str(self.tmp / "engine.sock")
        self.card: ModelCard | None = None  # the engine's, once it is ready
        self.engine: Child | None = None
        self.engine_ready: Connection | None = None
        self.front: list[Child | None] = [None] * config.http.workers
        self.stopping = False
        self.hangup = False  # SIGHUP: passed on to the front ends (they reload the key file)
        self._own_metrics_dir = MULTIPROC_ENV not in os.environ
        # The rate limits' buckets, one table for every front end (no name a slot file has).
        access = config.access
        limited = access.api_keys is not None or access.rate_limit is not None
        self.buckets = str(shm_dir() / f"{segment_prefix(self.pid)}quota") if limited else None

    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, self._on_hangup)
        try:
            check_access(self.config.access)  # a bad key file: one line, before the model loads
            check_tls(self.config.http)
            self._metrics_dir()
            self._check_port()
            if self.buckets is not None:
                BucketTable.remove(self.buckets)  # left by a killed supervisor of this pid
                BucketTable(self.buckets, create=True).close()
            self._start_engine()
            self._wait_engine_ready()
            together = self.ctx.Barrier(len(self.front))
            for index in range(len(self.front)):
                self._start_front(index, together)
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
            path = self.tmp / "metrics"
            path.mkdir()
            os.environ[MULTIPROC_ENV] = str(path)
            return
        for stale in Path(os.environ[MULTIPROC_ENV]).glob("*.db"):
            stale.unlink()

    def _check_port(self) -> None:
        """Fail at once, as one process would, when the port is taken (the probe is closed
        before any front end binds, so it never receives a connection)."""
        host, port = self.config.http.host, self.config.http.port
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:  # without SO_REUSEPORT: a second clipserve on the port must not pass
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((host, port))
        except OSError as e:
            raise StartupError(
                f"--host/--port: cannot listen on {self.config.http.host}:"
                f"{self.config.http.port} ({e.strerror})"
            ) from None

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
        deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
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

    def _start_front(self, index: int, together: Barrier | None = None) -> None:
        from clipserve.engine.frontend import frontend_main

        assert self.card is not None  # front ends start once the engine is ready
        args = (self.config, self.socket_path, self.card, index, self.pid, together, self.buckets)
        name = f"clipserve-frontend-{index}"
        process = self.ctx.Process(target=frontend_main, name=name, args=args)
        process.start()
        old = self.front[index]
        failures = old.failures if old else 0
        self.front[index] = Child(f"front end {index}", process, failures=failures)

    def _monitor(self) -> None:
        while not self.stopping:
            children = [c for c in (self.engine, *self.front) if c is not None]
            wait([c.process.sentinel for c in children if c.restart_at is None], timeout=0.2)
            if self.hangup:
                self.hangup = False
                self._pass_on_hangup()
            now = time.monotonic()
            for index, child in enumerate(self.front):
                if child is not None and self._due(child, now):
                    self._start_front(index)
            if self.engine is not None and self._due(self.engine, now):
                self._restart_engine()

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
            quick = now - child.started < 10.0
            child.failures = child.failures + 1 if quick else 1
            child.restart_at = now + (child.backoff_s() if quick else 0.0)
            log.error(
                "%s (pid %s) exited with %s; restarting it in %.1f s",
                child.name,
                child.process.pid,
                child.process.exitcode,
                child.restart_at - now,
            )
            if child.name != "engine" and child.process.pid is not None:
                remove_segments(self.pid, child.process.pid)
        return True

    def _restart_engine(self) -> None:
        self._start_engine()
        try:
            self._wait_engine_ready()
        except StartupError as e:
            log.error("the engine did not restart: %s", e)
            return
        pid = self.engine.process.pid if self.engine else None
        log.info("engine restarted (pid %s); front ends reconnect", pid)

    def _shutdown(self) -> None:
        """Front ends first (they drain their requests through the engine), then the engine."""
        self.stopping = True
        fronts = [c.process for c in self.front if c is not None]
        _terminate(fronts, self.config.http.drain_timeout_s + 10.0)
        if self.engine is not None:
            _terminate([self.engine.process], 30.0)
        remove_segments(self.pid)
        if self.buckets is not None:
            BucketTable.remove(self.buckets)
        if self._own_metrics_dir:
            os.environ.pop(MULTIPROC_ENV, None)
        shutil.rmtree(self.tmp, ignore_errors=True)


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


def supervise(config: ServerConfig) -> int:
    return Supervisor(config).run()
