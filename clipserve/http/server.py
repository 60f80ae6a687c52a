"""uvicorn, configured: the protocol of `http/guarded.py` over reads into a buffer of the
thread (`http/buffered.py`), and a server that drains on SIGTERM and exits 0. The CLI and the
test servers build their `uvicorn.Config` with `build_uvicorn_config`, so tests run the real
settings."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

import uvicorn

from clipserve.config import HttpConfig
from clipserve.http.buffered import BufferedReads
from clipserve.http.connections import AcceptGate, Refusals, adopt, refusal_room, take_queued
from clipserve.http.guarded import GuardedHttpProtocol
from clipserve.http.listeners import check_tls

log = logging.getLogger(__name__)
REPEAT_S = 1.0  # a SIGTERM this soon after the first is the same stop, not a second one


def protocol_class(config: HttpConfig) -> type[BufferedReads]:
    """A protocol class bound to these limits, with its own refusal count (one per server)."""
    refusals = Refusals(config.max_connections)
    guarded = type(
        "ClipserveHttpProtocol", (GuardedHttpProtocol,), {"limits": config, "refusals": refusals}
    )
    return type("ClipserveConnection", (BufferedReads,), {"inner": guarded})


# uvicorn's loggers without handlers of their own, passing their records to the root's.
UVICORN_TO_ROOT: dict[str, Any] = {
    "version": 1,
    "disable_existing_loggers": False,
    "loggers": {name: {"handlers": [], "propagate": True} for name in ("uvicorn", "uvicorn.error")},
}


def build_uvicorn_config(app: Any, config: HttpConfig, **overrides: Any) -> uvicorn.Config:
    """The uvicorn settings clipserve serves with; tests pass overrides such as a free port."""
    settings: dict[str, Any] = {
        "host": config.host,
        "port": config.port,
        "log_level": config.log_level,
        "http": protocol_class(config),
        "ws": "none",  # no WebSocket routes: an upgrade must not escape these limits
        "timeout_keep_alive": config.keep_alive_timeout_s,  # a float works: call_later's delay
        # uvicorn's int annotation notwithstanding, the float goes to wait_for as is (0: now).
        "timeout_graceful_shutdown": config.drain_timeout_s,
        "access_log": False,  # the observer's, where on (--log-format json)
        "server_header": False,
        # One accept round takes the whole queue before accepting can pause: fd_budget counts it.
        "backlog": refusal_room(config.max_connections),
    }
    if config.log_format == "json":  # uvicorn's lines through the root's JSON handler
        settings["log_config"] = UVICORN_TO_ROOT
    if config.ssl_certfile is not None:  # config.validate: the key comes with it
        check_tls(config)
        settings.update(ssl_certfile=config.ssl_certfile, ssl_keyfile=config.ssl_keyfile)
    settings.update(overrides)
    return uvicorn.Config(app, **settings)


class DrainingServer(uvicorn.Server):
    """uvicorn re-raises SIGTERM once its graceful shutdown is done, so a fully drained server
    would still die 'killed by signal'. Here a drained shutdown exits 0. Its protocol's
    socket budget pauses and resumes accepting through an `AcceptGate`.

    With `delay_s` (--shutdown-delay-s), SIGTERM first turns readiness to 503 and the server
    goes on serving that long, each answer closing its connection: a load balancer that probes
    stops sending, and clients reconnect elsewhere, before the listener closes. A second
    SIGTERM (a second or more after the first), or SIGINT (Ctrl-C), drains at once."""

    gate: AcceptGate | None = None

    def __init__(self, config: uvicorn.Config, delay_s: float = 0.0) -> None:
        super().__init__(config)
        self.delay_s = delay_s
        self.sigterm_at: float | None = None  # monotonic time of the SIGTERM the delay is for
        self.announced = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: it sets state only; on_tick (every 0.1 s) acts on it.
        now = time.monotonic()
        if sig == signal.SIGTERM and self.delay_s > 0:
            if self.sigterm_at is None and not self.should_exit:
                self.sigterm_at = now
                self._mark_stopping()
                return
            # A SIGTERM to the whole process group (systemd, `kill -- -PGID`) reaches a front
            # end twice: from the group and from the supervisor. Only a later one is a second.
            if self.sigterm_at is not None and now < self.sigterm_at + REPEAT_S:
                return
        super().handle_exit(sig, frame)

    def _mark_stopping(self) -> None:
        """Readiness 503, answers that close their connections (again each tick: a SIGTERM
        taken during the lifespan's startup comes before the app's pipeline and the gate)."""
        pipeline = getattr(getattr(self.config.app, "state", None), "pipeline", None)
        if pipeline is not None:
            pipeline.stopping = True
        if self.gate is not None:
            self.gate.refusals.stopping = True

    async def on_tick(self, counter: int) -> bool:
        if self.sigterm_at is not None and not self.should_exit:
            self._mark_stopping()
            if not self.announced:
                self.announced = True
                log.info("SIGTERM: readiness 503, serving %.1f s more, then draining", self.delay_s)
            if time.monotonic() >= self.sigterm_at + self.delay_s:
                self.should_exit = True
        return await super().on_tick(counter)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        protocol = getattr(self.config.http_protocol_class, "inner", None)
        if self.started and protocol is not None and issubclass(protocol, GuardedHttpProtocol):
            self.gate = protocol.refusals.gate = AcceptGate(self, protocol.refusals)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # Closing a listener resets every connection in its accept queue: requests their
        # clients have sent. Those are accepted first, and served (`GuardedHttpProtocol.
        # shutdown`); only a client that connects in the microseconds between the last accept
        # and the close is reset (with --workers N, the last front end to close takes the
        # queue the others left: the socket is shared; with --reuse-port each takes its own).
        queued = [] if self.gate is not None and self.gate.paused else take_queued(self)
        for server in self.servers:
            server.close()
        self.servers = []
        if self.gate is not None:
            self.gate.close()
        if queued:
            await adopt(self, queued)
        # The app's other listeners (gRPC) stop taking calls as HTTP does, not after its drain.
        drain = getattr(getattr(self.config.app, "state", None), "drain", None)
        if drain is not None:
            drain()
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def draining_server(config: uvicorn.Config, delay_s: float = 0.0) -> DrainingServer:
    return DrainingServer(config, delay_s)
