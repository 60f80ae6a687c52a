"""One HTTP/1.1 connection: uvicorn's httptools protocol with the limits it lacks.

uvicorn has settings for the keep-alive timeout (used) and, only in its slower h11 protocol, a
header size cap. It has nothing for a header cap under httptools, a connection that never
sends (or drips) its headers, a client that stops reading its answers, a cap on open
connections that refuses the excess fast, a cap on pipelined requests, or a lingering close;
and it drops what follows a request that asks to upgrade, so that its body is parsed as
requests. `GuardedHttpProtocol` adds and mends those; the fast path gains a few attribute
checks per request (docs/design.md).

Every socket counts against the budget in `http/connections.py`, checked against RLIMIT_NOFILE
at start: served connections up to --max-connections, then refusals (and probes), which close
within about two seconds; past the budget the server stops accepting and the kernel's accept
queue holds new clients.
"""

from __future__ import annotations

import asyncio
import http
import weakref
from typing import Any, ClassVar, cast

import httptools
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from clipserve.config import HttpConfig
from clipserve.http.connections import Refusals
from clipserve.http.cycle import Cycle, EarlyAnswerCycle
from clipserve.http.observer import new_request_id
from clipserve.http.probes import asks_probe
from clipserve.http.request import WATCH_SCOPE_KEY, DisconnectWatch
from clipserve.protocol.responses import encode_error

LINGER_IDLE_S = 1.0  # a lingering client that sends nothing for this long is done
# At shutdown, how long a connection accepted but not yet read from may take to send its first
# request (it is answered, then closed); clients send at once after connecting.
FIRST_REQUEST_GRACE_S = 1.0
# A chunked body's framing: per chunk, a size line of at most 16 hex digits (the parser's
# own limit) and two CRLFs; per body, the last chunk and short trailers. More is padding.
CHUNK_FRAMING = 16 + 4
FRAMING_SLACK = 256
# Requests read ahead of their answers on one connection (HTTP/1.1 pipelining): each is a
# cycle and its scope, and one 256 KiB read holds ~10k small ones. More get a 503.
MAX_PIPELINED = 64
# Past --max-connections, how long a connection may take to send its request line: a probe's
# is served, anything else (or nothing) gets a 503.
REFUSAL_WAIT_S = 1.0


class _StopParsing(Exception):
    """Raised from a parser callback once the connection is refused: the rest is not parsed."""


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
    close when nothing was sent), a cap on open connections (503 to all but probes) and on all
    sockets (accepting pauses), a cap on a chunked body's framing bytes (400), JSON 400s that follow
    the answers to the requests before the bad bytes, a lingering close whenever the
    server answers before the request body has arrived, a cap on pipelined requests (503), a
    client that takes none of its answer for --header-timeout-s aborted, and a request that asks
    to upgrade the connection served as plain HTTP/1.1 (`_upgrade_body`)."""

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
        self._held: bytes | None = None  # refused, its request line awaited (asks_probe)
        self._open_before = 0
        self._draining = False  # shut down before its first request's headers arrived
        # A refusal waiting for the answer to the request before it; what arrives meanwhile
        # is dropped (the parser has failed).
        self._answer: bytes | None = None
        # A body's bytes on the wire less its data, less an allowance per chunk: above 0, the
        # framing is padded (chunk sizes with leading zeros, extensions, trailers).
        self._framing = 0
        # The body bytes still to come of a request that asked to upgrade (the parser skips
        # them); 0 once they are in, then what arrives is dropped; -1: no such request.
        self._upgrade_left = -1
        self._stall_timer: asyncio.TimerHandle | None = None  # see pause_writing
        self._stall_left = 0  # bytes the transport held as the watch began
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
            # Refused once its request line shows it is not a probe's (those are served, then
            # the connection closes), or after REFUSAL_WAIT_S: cheap for a flood all the same.
            self._refused = True
            refusals.closing += 1
            self._held = b""
            self._open_before = open_before
            self._start_header_timer(self._refusal_wait())  # _header_timeout refuses it
            return
        self._start_header_timer(self.limits.header_timeout_s)

    def _refusal_wait(self) -> float:
        return min(REFUSAL_WAIT_S, self.limits.header_timeout_s)

    def _start_header_timer(self, timeout_s: float) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(timeout_s, self._header_timeout)

    def _refuse_connection(self) -> None:
        """The 503 of a connection past --max-connections, then a lingering close."""
        self._held = None
        self.refusals.log(self._open_before)
        pipeline = self.app_state.get("pipeline")
        if pipeline is not None:  # the lifespan's; not there before it starts
            pipeline.metrics.connections_refused.inc()
            pipeline.metrics.requests.labels("other", "503").inc()  # the 503 alert's too
        message = f"{self._open_before} connections open, the limit (--max-connections)"
        extra = [(b"retry-after", b"1"), (b"x-request-id", new_request_id().encode())]
        self.transport.write(self._error(503, "overloaded", message, extra))
        self.close_lingering()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._header_timer, self._linger_timer, self._stall_timer):
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
        if self._held is not None:  # refused unless it asks for a probe
            data = self._held + data
            probe = asks_probe(data)
            self._held = data if probe is None else None
            if probe is None:
                return
            if not probe:
                self._refuse_connection()
                return
            # A probe's headers come with its request line: a short wait, as for the line,
            # since its socket is one of the refusal room's.
            self._start_header_timer(self._refusal_wait())
        if self._linger_bytes >= 0:
            self._linger_bytes += len(data)
            return
        if self._answer is not None:
            return
        if self._upgrade_left >= 0:
            self._upgrade_body(data)
            return
        cycle = self.cycle
        if cycle is not None and cycle.more_body:  # body bytes
            self._framing += len(data)
            self._feed(data)
            if self._framing > 0:
                message = "chunked body: chunk-size lines, extensions or trailers too long"
                self._refuse(400, "invalid_request", message)
                return
        else:  # bytes that start or continue a request's headers
            self._header_bytes += len(data)
            if self._header_bytes <= self._max_header_bytes:
                self._feed(data)
            elif not self._feed_within_cap(data):
                return
            if self._header_bytes and self._header_timer is None and self._linger_bytes < 0:
                # Headers of a later request on a kept-alive connection started arriving.
                self._header_timer = self.loop.call_later(
                    self.limits.header_timeout_s, self._header_timeout
                )
        self._body_pending()

    def _body_pending(self) -> None:
        cycle = self.cycle
        if cycle is not None and cycle.more_body:
            # Paused here, once the packet is parsed, not in on_body: a body that ended in it
            # (the usual request) costs no pause and resume of the socket.
            if cast(Cycle, cycle).size > HIGH_WATER_LIMIT:
                self.flow.pause_reading()
            if type(cycle) is Cycle:
                # Its handler may answer before the rest arrives; only such cycles pay for it.
                cycle.__class__ = EarlyAnswerCycle

    def _feed(self, data: bytes | memoryview) -> None:
        """uvicorn's `data_received`, less its drop of what follows a request that asks to
        upgrade: the parser skips such a request's body, which would be parsed as requests."""
        if self.timeout_keep_alive_task is not None:
            self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as e:  # the request is complete: its body follows
            self._upgrade_body(data[e.args[0] :])
        except httptools.HttpParserError as e:
            if isinstance(e.__context__, _StopParsing):  # refused already
                return
            message = "Invalid HTTP request received."
            self.logger.warning(message)
            self.send_400_response(message)

    def _upgrade_body(self, data: bytes | memoryview) -> None:
        """The body of a request that asked to upgrade the connection (`Upgrade: h2c` from
        `curl --http2`), by its Content-Length; after it, every byte is dropped and the
        connection closes after the answer. RFC 9110 7.8 lets a server ignore the offer."""
        left = self._upgrade_left
        if left <= 0:
            return
        chunk = bytes(data[:left])  # the read may be the thread's buffer (http/buffered.py)
        self._upgrade_left = left - len(chunk)
        cycle = cast(Cycle, self.cycle)
        if not cycle.response_complete:
            cycle.take(chunk)
            cycle.more_body = self._upgrade_left > 0
            cycle.message_event.set()
        self._body_pending()

    def _feed_within_cap(self, data: bytes) -> bool:
        """Feed only what fits under the cap: the headers must end inside it, whatever the
        chunking. False if they did not (answered 431)."""
        limit = self.limits.max_header_bytes
        room = limit - (self._header_bytes - len(data))
        view = memoryview(data)
        self._feed(view[:room])
        if self._header_bytes:  # on_headers_complete resets the count: they did not end
            message = f"request headers exceed {limit} bytes (--max-header-bytes)"
            self._refuse(431, "headers_too_large", message)
            return False
        if self._upgrade_left >= 0:  # the headers asked to upgrade: the rest is their body
            self._upgrade_body(view[room:])
        elif self._linger_bytes < 0 and self._answer is None:  # else the parser has failed
            self._feed(view[room:])
        return True

    def on_headers_complete(self) -> None:
        self._header_bytes = 0
        self._framing = -FRAMING_SLACK
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        self.scope[WATCH_SCOPE_KEY] = self._watch  # type: ignore[literal-required]
        upgrade = self.parser.should_upgrade()
        if upgrade:
            self._upgrade_left = self._upgrade_length()
        previous = cast("Cycle | None", self.cycle)
        HttpToolsProtocol.on_headers_complete(self)
        cycle = self.cycle
        if type(cycle) is RequestResponseCycle:  # just built (not an upgrade's early return)
            cycle.__class__ = Cycle
            cast(Cycle, cycle).adopt()
        if upgrade:  # what follows its body is dropped: a lingering close, no reset
            cast(Cycle, self.cycle).linger(self)
        elif self._draining or self._refused or self.refusals.stopping:
            # The one request a draining server still takes; a probe's past the limit; any
            # during --shutdown-delay-s.
            self.cycle.keep_alive = False
        pipeline = self.pipeline
        if pipeline and pipeline[0][0] is cycle and previous is not None:
            # uvicorn marks only its latest cycle disconnected when the client goes: see
            # Cycle.send for the ones parsed before it
            previous.overtaken = True
        if pipeline and len(pipeline) >= MAX_PIPELINED:  # with the one answering: 64
            message = f"over {MAX_PIPELINED} requests pipelined on one connection"
            self._refuse(503, "overloaded", message, [(b"retry-after", b"1")])
            raise _StopParsing

    def _upgrade_length(self) -> int:
        """The body length of a request that asks to upgrade; a chunked one is refused (the
        parser, which frames chunks, skips its body)."""
        length = 0
        for name, value in self.headers:
            if name == b"transfer-encoding":
                self._refuse(
                    400,
                    "invalid_request",
                    "a request that asks to upgrade the connection must not be chunked",
                )
                raise _StopParsing
            if name == b"content-length":
                length = int(value)  # the parser checked its digits
        return length

    def on_body(self, body: bytes) -> None:
        # HttpToolsProtocol's, with the chunk kept by the cycle (http/cycle.py), not copied.
        self._framing -= len(body)
        cycle = cast(Cycle, self.cycle)
        if cycle.response_complete:  # (an upgrade's body never reaches the parser's callbacks)
            return
        cycle.take(body)  # past HIGH_WATER_LIMIT, data_received pauses reading
        cycle.message_event.set()

    def on_chunk_header(self) -> None:
        # Unused allowance does not carry over: tiny chunks would save it up for a trailer.
        self._framing = max(self._framing, -FRAMING_SLACK) - CHUNK_FRAMING
        # Trailers follow the last chunk, and uvicorn appends them to the list its scope holds:
        # a new one keeps them out of the request's headers.
        self.headers = []

    def on_message_complete(self) -> None:
        self._framing = -(1 << 62)  # what follows in the packet is the next request's
        if self._upgrade_left > 0:  # skipped by the parser: its body is still to come
            return
        HttpToolsProtocol.on_message_complete(self)

    def on_response_complete(self) -> None:
        if self._answer is None or self.pipeline:
            HttpToolsProtocol.on_response_complete(self)
            transport = self.transport
            if transport.is_closing() and transport.get_write_buffer_size():
                self._watch_writes()  # closed after its answer (not kept alive), unflushed
            return
        self.count_response()  # the answers ahead of the bad bytes are written: now theirs
        answer, self._answer = self._answer, None
        if not self.transport.is_closing():
            self.transport.write(answer)
            self.close_lingering()

    # A client that takes none of what is written to it holds its connection slot (and, while
    # writes are paused, its request's task) for as long as it likes. Watched while writes are
    # paused and while a closing transport still holds bytes: cut off (aborted) once a whole
    # --header-timeout-s passes in which it took nothing.

    def pause_writing(self) -> None:
        HttpToolsProtocol.pause_writing(self)
        self._watch_writes()

    def resume_writing(self) -> None:
        if self._stall_timer is not None:  # it took some: writes go on
            self._stall_timer.cancel()
            self._stall_timer = None
        HttpToolsProtocol.resume_writing(self)

    def _watch_writes(self) -> None:
        if self._stall_timer is None:
            self._stall_left = self.transport.get_write_buffer_size()
            timeout = self.limits.header_timeout_s
            self._stall_timer = self.loop.call_later(timeout, self._writes_checked)

    def _writes_checked(self) -> None:
        self._stall_timer = None
        left = self.transport.get_write_buffer_size()
        if left and left >= self._stall_left:
            self.transport.abort()
        elif left:  # a slow reader, not a stalled one
            self._watch_writes()

    def _close(self) -> None:
        """Close the transport, which flushes what it holds first: watched, as above."""
        self.transport.close()
        if self.transport.get_write_buffer_size():
            self._watch_writes()

    def timeout_keep_alive_handler(self) -> None:
        if not self.transport.is_closing():
            self._close()

    def count_response(self) -> None:
        """What on_response_complete counts, without its keep-alive work on a closing line."""
        self.server_state.total_requests += 1

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self._refused and self.cycle is None:  # no probe's head in time: refused after all
            self._refuse_connection()
            return
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

    def _refuse(
        self,
        status: int,
        code: str,
        message: str,
        extra: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        if self._linger_bytes >= 0 or self._answer is not None or self.transport.is_closing():
            return
        answer = self._error(status, code, message, extra)
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
            self._close()
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
            self._close()
            return
        self._linger_bytes = 0
        self._linger_timer = self.loop.call_later(min(LINGER_IDLE_S, remaining), self._linger_check)
