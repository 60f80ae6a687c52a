"""uvicorn, configured: its httptools protocol with the connection limits it lacks.

uvicorn has settings for the keep-alive timeout (used) and, only in its slower h11 protocol, a
header size cap. It has nothing for a header cap under httptools, a connection that never
sends (or drips) its headers, a cap on open connections that refuses the excess fast, or a
lingering close. `GuardedHttpProtocol` adds those to `HttpToolsProtocol`; the fast path gains
a few attribute checks per request (docs/design.md). The CLI and the test servers build
their `uvicorn.Config` with `build_uvicorn_config`, so tests run the real settings.

Every socket counts against the budget in `http/connections.py`, checked against RLIMIT_NOFILE
at start: served connections up to --max-connections, then refusals, which close within a
second; past the budget the server stops accepting and the kernel's accept queue holds new
clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import signal
import socket
import ssl
import threading
import weakref
from collections.abc import Iterator
from typing import Any, ClassVar, cast

import uvicorn
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from clipserve.config import HttpConfig
from clipserve.errors import StartupError
from clipserve.http.buffered import BufferedReads
from clipserve.http.connections import (
    AcceptGate,
    Refusals,
    adopt,
    refusal_room,
    take_queued,
)
from clipserve.http.cycle import Cycle, EarlyAnswerCycle
from clipserve.http.request import WATCH_SCOPE_KEY, DisconnectWatch
from clipserve.protocol.responses import encode_error

log = logging.getLogger(__name__)

LINGER_IDLE_S = 1.0  # a lingering client that sends nothing for this long is done
# At shutdown, how long a connection accepted but not yet read from may take to send its first
# request (it is answered, then closed); clients send at once after connecting.
FIRST_REQUEST_GRACE_S = 1.0
# A chunked body's framing: per chunk, a size line of at most 16 hex digits (the parser's
# own limit) and two CRLFs; per body, the last chunk and short trailers. More is padding.
CHUNK_FRAMING = 16 + 4
FRAMING_SLACK = 256


def error_bytes(
    status: int, code: str, message: str, extra: list[tuple[bytes, bytes]] | None = None
) -> bytes:
    """A complete JSON error response that closes the connection, for the protocol layer."""
    body = encode_error(code, message)
    lines = [
        b"HTTP/1.1 %d %s" % (status, http.HTTPStatus(status).phrase.encode()),
        b"content-type: application/json",
        b"content-length: %d" % len(body),
        b"connection: close",
        *(name + b": " + value for name, value in extra or []),
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


class GuardedHttpProtocol(HttpToolsProtocol):
    """`HttpToolsProtocol` with a header byte cap (431), a header timeout (408, or a silent
    close when nothing was sent), a cap on open connections (503 at once) and on all sockets
    (accepting pauses), a cap on a chunked body's framing bytes (400), JSON 400s that follow
    the answers to the requests before the bad bytes, and a lingering close whenever the
    server answers before the request body has arrived."""

    limits: ClassVar[HttpConfig]
    refusals: ClassVar[Refusals]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_bytes = 0  # of the request whose headers are arriving
        self._max_header_bytes = self.limits.max_header_bytes
        self._header_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._linger_deadline = 0.0
        self._linger_bytes = -1  # -1: not lingering; else bytes dropped since the last check
        self._refused = False
        self._draining = False  # shut down before its first request's headers arrived
        # A refusal waiting for the answer to the request before it; what arrives meanwhile
        # is dropped (the parser has failed).
        self._answer: bytes | None = None
        # A body's bytes on the wire less its data, less an allowance per chunk: above 0, the
        # framing is padded (chunk sizes with leading zeros, extensions, trailers).
        self._framing = 0
        # Its requests' wait for their answers learns of a disconnect from connection_lost.
        self._watch = DisconnectWatch()
        refusals = self.refusals
        refusals.pending += 1  # built as the socket is accepted: counted from here on
        # A TLS handshake that fails reaches neither connection_made nor connection_lost:
        # its count is given back once the protocol is collected.
        self._unmade = weakref.finalize(self, refusals.unmade_soon, self.loop)
        self._unmade.atexit = False  # nothing to give back once the process exits
        gate = refusals.gate
        if gate is not None and refusals.full(gate):
            gate.pause_soon()

    # Connection lifecycle

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        refusals = self.refusals
        refusals.pending -= 1
        self._unmade.detach()
        super().connection_made(transport)  # registered, so a shutdown closes it too
        self._watch.listen = self.flow.resume_reading
        open_before = len(self.connections) - refusals.closing - 1
        if open_before >= self.limits.max_connections:
            # Answered at once, before the request arrives: refusing must stay cheap for a
            # flood, and the client reads the answer after it has sent its request.
            self._refused = True
            refusals.closing += 1
            refusals.log(open_before)
            message = f"{open_before} connections open, the limit (--max-connections)"
            transport.write(self._error(503, "overloaded", message, [(b"retry-after", b"1")]))
            self.close_lingering()
            return
        self._header_timer = self.loop.call_later(
            self.limits.header_timeout_s, self._header_timeout
        )

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._header_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        refusals = self.refusals
        if self._refused:
            refusals.closing -= 1
        super().connection_lost(exc)
        self._watch.lost()
        refusals.resume_if_room()

    def shutdown(self) -> None:
        if self._linger_bytes >= 0:
            self.transport.close()
        elif self.cycle is None and not self._refused:
            # Accepted, no request read yet: its client has likely sent one already, and a
            # close would lose it. Its first request is answered, then the connection closes.
            self._draining = True
            self.loop.call_later(FIRST_REQUEST_GRACE_S, self._drain_expired)
        else:
            super().shutdown()

    def _drain_expired(self) -> None:
        if self.cycle is None:
            self.transport.close()

    # Reading

    def data_received(self, data: bytes) -> None:
        if self._linger_bytes >= 0:
            self._linger_bytes += len(data)
            return
        if self._answer is not None:
            return
        # The base class is called by name on this per-request path: no super() object.
        cycle = self.cycle
        if cycle is not None and cycle.more_body:  # body bytes
            self._framing += len(data)
            HttpToolsProtocol.data_received(self, data)
            if self._framing > 0:
                message = "chunked body: chunk-size lines, extensions or trailers too long"
                self._refuse(400, "invalid_request", message)
                return
        else:  # bytes that start or continue a request's headers
            self._header_bytes += len(data)
            if self._header_bytes <= self._max_header_bytes:
                HttpToolsProtocol.data_received(self, data)
            elif not self._feed_within_cap(data):
                return
            if self._header_bytes and self._header_timer is None and self._linger_bytes < 0:
                # Headers of a later request on a kept-alive connection started arriving.
                self._header_timer = self.loop.call_later(
                    self.limits.header_timeout_s, self._header_timeout
                )
        cycle = self.cycle
        if cycle is not None and cycle.more_body:
            # Paused here, once the packet is parsed, not in on_body: a body that ended in it
            # (the usual request) costs no pause and resume of the socket.
            if cast(Cycle, cycle).size > HIGH_WATER_LIMIT:
                self.flow.pause_reading()
            if type(cycle) is Cycle:
                # Its handler may answer before the rest arrives; only such cycles pay for it.
                cycle.__class__ = EarlyAnswerCycle

    def _feed_within_cap(self, data: bytes) -> bool:
        """Feed only what fits under the cap: the headers must end inside it, whatever the
        chunking. False if they did not (answered 431)."""
        limit = self.limits.max_header_bytes
        room = limit - (self._header_bytes - len(data))
        view = memoryview(data)
        super().data_received(view[:room])  # type: ignore[arg-type]
        if self._header_bytes:  # on_headers_complete resets the count: they did not end
            message = f"request headers exceed {limit} bytes (--max-header-bytes)"
            self._refuse(431, "headers_too_large", message)
            return False
        if self._linger_bytes < 0:
            super().data_received(view[room:])  # type: ignore[arg-type]
        return True

    def on_headers_complete(self) -> None:
        self._header_bytes = 0
        self._framing = -FRAMING_SLACK
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        self.scope[WATCH_SCOPE_KEY] = self._watch  # type: ignore[literal-required]
        HttpToolsProtocol.on_headers_complete(self)
        cycle = self.cycle
        if type(cycle) is RequestResponseCycle:  # just built (not an upgrade's early return)
            cycle.__class__ = Cycle
            cast(Cycle, cycle).adopt()
        if self._draining:
            self.cycle.keep_alive = False  # the one request a draining server still takes

    def on_body(self, body: bytes) -> None:
        # HttpToolsProtocol's, with the chunk kept by the cycle (http/cycle.py), not copied.
        self._framing -= len(body)
        cycle = cast(Cycle, self.cycle)
        if (self.parser.should_upgrade() and self._should_upgrade()) or cycle.response_complete:
            return
        cycle.take(body)  # past HIGH_WATER_LIMIT, data_received pauses reading
        cycle.message_event.set()

    def on_chunk_header(self) -> None:
        self._framing -= CHUNK_FRAMING

    def on_message_complete(self) -> None:
        self._framing = -(1 << 62)  # what follows in the packet is the next request's
        HttpToolsProtocol.on_message_complete(self)

    def on_response_complete(self) -> None:
        if self._answer is None or self.pipeline:
            HttpToolsProtocol.on_response_complete(self)
            return
        self.count_response()  # the answers ahead of the bad bytes are written: now theirs
        answer, self._answer = self._answer, None
        if not self.transport.is_closing():
            self.transport.write(answer)
            self.close_lingering()

    def count_response(self) -> None:
        """What on_response_complete counts, without its keep-alive work on a closing line."""
        self.server_state.total_requests += 1

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self._header_bytes == 0:  # nothing of a request was sent: nothing to answer
            self.transport.close()
            return
        timeout = self.limits.header_timeout_s
        message = f"request headers not received within {timeout} s (--header-timeout-s)"
        self._refuse(408, "header_timeout", message)

    # Answers from the protocol layer: JSON, then a lingering close

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, "invalid_request", msg)

    def _error(
        self, status: int, code: str, message: str, extra: list[tuple[bytes, bytes]] | None = None
    ) -> bytes:
        headers = [*self.server_state.default_headers, *(extra or [])]
        return error_bytes(status, code, message, headers)

    def _refuse(self, status: int, code: str, message: str) -> None:
        if self._linger_bytes >= 0 or self._answer is not None or self.transport.is_closing():
            return
        answer = self._error(status, code, message)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if cycle.more_body and self.pipeline and self.pipeline[0][0] is cycle:
                self.pipeline.popleft()  # the bad request itself, queued behind another
            elif cycle.more_body and not cycle.response_started:
                # This request's own body is malformed: its handler sees a disconnect.
                cycle.disconnected = True
                cycle.message_event.set()
                self.transport.write(answer)
                self.close_lingering()
                return
            # The bad bytes follow a request whose answer is not written yet: theirs comes
            # after it (on_response_complete), as HTTP/1.1 orders answers.
            self._answer = answer
            return
        self.transport.write(answer)
        self.close_lingering()

    def close_lingering(self) -> None:
        """Half-close, then read and drop what the client still sends for a bounded time
        (nginx's lingering close): closing with unread input sends a reset, and a client
        still sending its body would lose the answer with it."""
        transport = self.transport
        if self._linger_bytes >= 0 or transport.is_closing():
            return
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        self._unset_keepalive_if_required()
        timeout = self.limits.linger_timeout_s
        if self._refused:  # a refused client has sent its request by now: free the socket
            timeout = min(timeout, LINGER_IDLE_S)
        if timeout <= 0 or not transport.can_write_eof():
            transport.close()
            return
        self._linger_bytes = 0
        self._linger_deadline = self.loop.time() + timeout
        transport.write_eof()
        if self.flow is not None:  # reading may be paused by a body nobody read
            self.flow.resume_reading()
        self._linger_timer = self.loop.call_later(min(LINGER_IDLE_S, timeout), self._linger_check)

    def _linger_check(self) -> None:
        remaining = self._linger_deadline - self.loop.time()
        if self._linger_bytes == 0 or remaining <= 0:  # quiet for a while, or out of time
            self._linger_timer = None
            self.transport.close()
            return
        self._linger_bytes = 0
        self._linger_timer = self.loop.call_later(min(LINGER_IDLE_S, remaining), self._linger_check)


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


def bind_port(host: str, port: int, option: str, *, reuse_port: bool = False) -> socket.socket:
    """The port bound, not listening, or StartupError naming `option` when anything holds it.
    `reuse_port`: then rebound with SO_REUSEPORT alone, so the front ends' gRPC servers (which
    cannot serve on an inherited socket) and, with --reuse-port, their HTTP listeners bind
    beside it, while a second server cannot (without SO_REUSEADDR on the held socket, neither
    another SO_REUSEADDR server nor a second clipserve binds the port while nothing listens)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:  # without SO_REUSEPORT: a second clipserve on the port must not pass
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        if reuse_port:
            address = sock.getsockname()  # the port bound, also where --port 0 chose one
            sock.close()
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(address)
    except OSError as e:
        sock.close()
        raise StartupError(f"{option}: cannot listen on {host}:{port} ({e.strerror})") from None
    return sock


def beside(held: socket.socket) -> socket.socket:
    """A socket of this process's own on `held`'s address (bound with SO_REUSEPORT): with
    `--reuse-port` each front end listens on one, and the kernel spreads new connections over
    the listening ones by a hash of each connection's addresses."""
    sock = socket.socket(held.family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(held.getsockname())  # all of it: an IPv6 address's scope too
    except OSError:
        sock.close()
        raise
    return sock


def check_tls(config: HttpConfig) -> None:
    """Load the certificate and key once, so a bad pair is a one-line StartupError rather than
    uvicorn's traceback once the model has loaded (or a front end that never starts)."""
    if config.ssl_certfile is None or config.ssl_keyfile is None:
        return
    try:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(config.ssl_certfile, config.ssl_keyfile)
    except (OSError, ssl.SSLError) as e:
        raise StartupError(
            f"--ssl-certfile {config.ssl_certfile} / --ssl-keyfile {config.ssl_keyfile}: {e}"
        ) from None


class DrainingServer(uvicorn.Server):
    """uvicorn re-raises SIGTERM once its graceful shutdown is done, so a fully drained server
    would still die 'killed by signal'. Here a drained shutdown exits 0. Its protocol's
    socket budget pauses and resumes accepting through an `AcceptGate`."""

    gate: AcceptGate | None = None

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


def draining_server(config: uvicorn.Config) -> DrainingServer:
    return DrainingServer(config)
