"""The connection budget of one server process: sockets served up to --max-connections, then
refusals (503 but to probes, closed within about two seconds), then accepting paused so the
kernel's accept queue holds new clients; and the open-file limit checked against it at start
(`fd_budget`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import math
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import uvicorn

from clipserve.errors import StartupError

log = logging.getLogger("clipserve.http.server")

CAP_LOG_INTERVAL_S = 10.0  # at most one "connection cap hit" warning per interval
COLLECT_INTERVAL_S = 5.0  # at most one garbage collection per interval before a pause
FD_HEADROOM = 256  # descriptors the process needs besides its client sockets


def refusal_room(max_connections: int) -> int:
    """Sockets allowed beyond --max-connections while refusals close; also the listen backlog,
    which bounds what one accept round brings in before accepting pauses."""
    return max(64, max_connections // 4)


def fd_budget(max_connections: int) -> int:
    """Descriptors a server process may need: connections, refusals closing, one accept round
    past the pause, and the process's own files."""
    return max_connections + 2 * refusal_room(max_connections) + FD_HEADROOM


class Refusals:
    """Connections refused at --max-connections, shared by one server's connections: how
    many are still closing (they do not count as open), sockets accepted but not yet
    connected, the gate that pauses accepting past the socket budget, a rate-limited
    warning (a flood of refusals must not flood the log), and whether the server stops."""

    def __init__(self, max_connections: int) -> None:
        self.closing = 0
        self.pending = 0  # protocols built for accepted sockets, connection_made not yet run
        room = refusal_room(max_connections)
        self.pause_at = max_connections + room
        self.resume_below = max_connections + room // 2
        self.gate: AcceptGate | None = None  # set once the server listens (DrainingServer)
        self.last = -math.inf
        self.suppressed = 0
        # SIGTERM with --shutdown-delay-s: answers close their connections, so clients move
        # to other replicas before the drain (DrainingServer.handle_exit).
        self.stopping = False

    def unmade_soon(self, loop: asyncio.AbstractEventLoop) -> None:
        """A protocol collected without its connection made (a failed TLS handshake): from
        the garbage collector, in whichever thread it runs, so counted on the loop."""
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nothing to count
            loop.call_soon_threadsafe(self._unmade)

    def _unmade(self) -> None:
        self.pending -= 1
        self.resume_if_room()

    def sockets(self, gate: AcceptGate) -> int:
        """Sockets held: connections, and those accepted but not yet connected."""
        return len(gate.server.server_state.connections) + self.pending

    def full(self, gate: AcceptGate) -> bool:
        return self.sockets(gate) >= self.pause_at

    def resume_if_room(self) -> None:
        """Accepting resumed if it is paused and enough sockets have gone."""
        gate = self.gate
        if gate is not None and gate.paused and self.sockets(gate) < self.resume_below:
            gate.resume_soon()

    def log(self, open_connections: int) -> None:
        now = time.monotonic()
        if now - self.last < CAP_LOG_INTERVAL_S:
            self.suppressed += 1
            return
        log.warning(
            "refusing connections: %d open, the --max-connections limit (%d more refused since "
            "the last such message)",
            open_connections,
            self.suppressed,
        )
        self.last, self.suppressed = now, 0


def ensure_fd_limit(max_connections: int) -> None:
    """Raise the soft open-file limit to `fd_budget`; a hard limit below it is a StartupError
    (past it, accepting fails, and uvloop then drops queued clients with a reset)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = fd_budget(max_connections)
    if hard != resource.RLIM_INFINITY and hard < need:
        fits = max((m for m in range(1, max_connections) if fd_budget(m) <= hard), default=0)
        lower = f" or lower --max-connections to {fits}" if fits else ""
        raise StartupError(
            f"open-file limit {hard} is below the {need} descriptors --max-connections "
            f"{max_connections} needs (connections, refusals, {FD_HEADROOM} for the process): "
            f"raise it (ulimit -n {need}){lower}"
        )
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def connection_factory(server: uvicorn.Server) -> Callable[[], asyncio.Protocol]:
    """The protocol factory uvicorn's listeners use, for sockets accepted elsewhere."""
    protocol: Any = server.config.http_protocol_class  # uvicorn's classes take these keywords
    factory: Callable[[], asyncio.Protocol] = functools.partial(
        protocol,
        config=server.config,
        server_state=server.server_state,
        app_state=server.lifespan.state,
    )
    return factory


def take_queued(server: uvicorn.Server) -> list[socket.socket]:
    """Every connection waiting in the server's listeners' accept queues, up to its backlog:
    at shutdown, what a listener's close would reset."""
    taken: list[socket.socket] = []
    for listener in (s for server_ in server.servers for s in server_.sockets):
        # A duplicate: asyncio's wrapper of the listener does not expose accept().
        with socket.socket(fileno=os.dup(listener.fileno())) as dup:
            dup.setblocking(False)
            while len(taken) < server.config.backlog:
                try:
                    conn, _ = dup.accept()
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as e:  # EMFILE and kin: what is left stays queued
                    log.warning("draining the accept queue: %s", e)
                    break
                conn.setblocking(False)
                taken.append(conn)
    return taken


async def adopt(server: uvicorn.Server, accepted: list[socket.socket]) -> None:
    """Serve sockets accepted elsewhere as the server's listener would have: registered
    connections, which a shutdown that follows treats as any other."""
    loop = asyncio.get_running_loop()
    factory = connection_factory(server)
    results = await asyncio.gather(
        *(loop.connect_accepted_socket(factory, s, ssl=server.config.ssl) for s in accepted),
        return_exceptions=True,
    )
    failed = [s for s, r in zip(accepted, results, strict=True) if isinstance(r, BaseException)]
    for sock in failed:  # a TLS handshake that failed, a client gone meanwhile
        sock.close()
    log.info("shutdown: %d connections from the accept queue served", len(accepted) - len(failed))


class AcceptGate:
    """Stops and restarts accepting on a uvicorn server's listeners. Neither asyncio nor
    uvloop can pause a listener, so pausing closes it and keeps a duplicate of each socket:
    the socket, and its accept queue where new clients wait (no reset), live on, and resuming
    serves the duplicates. Both run from the loop, never inside an accept callback."""

    def __init__(self, server: uvicorn.Server, refusals: Refusals) -> None:
        self.server = server
        self.refusals = refusals  # the socket budget
        self._collected = -math.inf
        self.paused = False
        self.closed = False
        self._held: list[socket.socket] = []
        self._scheduled = False
        self._task: asyncio.Task[None] | None = None

    def pause_soon(self) -> None:
        if not (self.paused or self._scheduled or self.closed):
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._pause)

    def _pause(self) -> None:
        self._scheduled = False
        if self.paused or self.closed:
            return
        # Failed TLS handshakes count until their protocols are collected
        # (Refusals.unmade_soon): collect, and decide once their callbacks have run. A young
        # collection every time (a handshake that just failed lies there, and while serving
        # young collections are rare by design, collector.py); a full one once per interval.
        if time.monotonic() - self._collected >= COLLECT_INTERVAL_S:
            self._collect()
        else:
            gc.collect(1)
        self._scheduled = True
        asyncio.get_running_loop().call_soon(self._pause_if_full)

    def _collect(self) -> None:
        # A full collection: tens of ms with torch loaded, so at most one per interval; a
        # protocol that lived through a collection is freed by nothing less.
        self._collected = time.monotonic()
        gc.collect()

    def _pause_if_full(self) -> None:
        self._scheduled = False
        if not (self.paused or self.closed) and self.refusals.full(self):
            self._close_listeners()

    def _close_listeners(self) -> None:
        self.paused = True
        for server in self.server.servers:
            self._held += [socket.socket(fileno=os.dup(s.fileno())) for s in server.sockets]
            server.close()
        self.server.servers = []
        log.warning("accepting paused: %d sockets open", len(self.server.server_state.connections))
        self._recheck_later()

    def _recheck_later(self) -> None:
        asyncio.get_running_loop().call_later(COLLECT_INTERVAL_S, self._recheck)

    def _recheck(self) -> None:
        """While paused, every interval: failed handshakes of clients that stayed long (until
        the handshake timed out) may be all that holds the budget, and no connection_lost
        will come for them."""
        if not self.paused or self.closed:
            return
        if self._task is None:
            self._collect()
            asyncio.get_running_loop().call_soon(self._resume_if_room)
        else:
            self._recheck_later()

    def _resume_if_room(self) -> None:
        if not self.paused or self.closed:
            return
        self.refusals.resume_if_room()
        self._recheck_later()  # a no-op once resumed

    def resume_soon(self) -> None:
        if self.paused and self._task is None and not self.closed:
            self._task = asyncio.get_running_loop().create_task(self._resume())

    async def _resume(self) -> None:
        config, server = self.server.config, self.server
        factory = connection_factory(server)
        loop = asyncio.get_running_loop()
        try:
            while self._held and not self.closed:
                sock = self._held.pop()
                listener = await loop.create_server(
                    factory, sock=sock, ssl=config.ssl, backlog=config.backlog
                )
                server.servers.append(listener)
            self.paused = False
        finally:
            self._task = None

    def close(self) -> None:
        """At shutdown: accept nothing more."""
        self.closed = True
        for sock in self._held:
            sock.close()
        self._held.clear()
