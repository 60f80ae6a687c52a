"""uvicorn's request-response cycle, less the copies of each request body and one write per
answer: what a bare uvicorn server pays on every request, here paid less (for a 150 KB body,
3.6% of the protocol's instructions for the one write and a one-chunk body, 19% more for a body
of several chunks; bench/results/http-cycle*.json, docs/design.md#http-layer).

- A body: uvicorn gathers it into a bytearray (a copy of every chunk the parser hands over, and
  more as the bytearray grows) and hands it on as bytes (a second copy of all of it). `Cycle`
  keeps the parser's chunks as they are and joins them once, as it hands the body on: no copy
  for a body that arrives as one chunk, one for a body of several (a 150 KB tensor often is).
- An answer: uvicorn writes the head when the app sends it and the body on the next message: two
  writes, two TCP segments on a kept-alive connection. `Cycle` holds the head until the cycle's
  next write and sends both in one (a writev where the transport has one). The head goes
  out alone for a HEAD (uvicorn writes no body for it) and on a close (uvicorn closes the
  connection of an app that stops or fails after its head).

`GuardedHttpProtocol` (http/server.py) makes every cycle uvicorn builds a `Cycle` as its headers
complete, before its task first runs, and feeds body chunks through `take`; a cycle whose body
is still arriving once its packet is parsed becomes an `EarlyAnswerCycle`.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol, runtime_checkable

from uvicorn._types import ASGIReceiveEvent, ASGISendEvent
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

SMALL_CHUNK = 4096  # body chunks below this are gathered by copy, not kept one object each


class _Passing(asyncio.Transport):
    """A cycle's view of its connection's transport: what a cycle calls, passed on."""

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__()
        self._transport = transport

    def write(self, data: bytes | bytearray | memoryview[int]) -> None:
        self._transport.write(data)

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def close(self) -> None:
        self._transport.close()

    def get_protocol(self) -> Any:
        return self._transport.get_protocol()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)


class _HeldHead(_Passing):
    """The first write (the head) waits for the second, then both go out in one call."""

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__(transport)
        self._head: bytes | None = None
        self._sent = False  # the head is out: writes pass straight through

    def write(self, data: bytes | bytearray | memoryview[int]) -> None:
        if self._sent:
            self._transport.write(data)
        elif self._head is None:
            self._head = bytes(data)
        else:
            head, self._head, self._sent = self._head, None, True
            self._transport.writelines((head, data))

    def flush(self) -> None:
        head, self._head, self._sent = self._head, None, True
        if head is not None:
            self._transport.write(head)

    def close(self) -> None:
        self.flush()
        self._transport.close()


class Cycle(RequestResponseCycle):
    """One request and its answer on a connection; see the module's note."""

    body: Any  # the first chunk received and not yet handed on (uvicorn's: a bytearray)
    # The chunks after it; small ones copied into a bytearray at the end, so that a body sent
    # in tiny chunks costs its bytes, not an object each (~35 bytes) beyond what `size` counts.
    rest: list[bytes | bytearray] | None
    size: int  # bytes received and not yet handed on: the flow control's measure
    held: _HeldHead | None
    overtaken = False  # another request was parsed behind this one before its answer

    def adopt(self) -> None:
        """Made a `Cycle` after uvicorn built it (its __init__ has run): nothing received yet."""
        self.body = b""
        self.rest = None
        self.size = 0
        self.held = None

    def take(self, chunk: bytes) -> None:
        """A body chunk from the parser (a bytes object of its own)."""
        first = not self.size
        self.size += len(chunk)
        if first:
            self.body = chunk
            return
        if self.rest is None:
            self.rest = []
        rest = self.rest
        if len(chunk) >= SMALL_CHUNK:
            rest.append(chunk)
        elif rest and type(last := rest[-1]) is bytearray:
            last += chunk
        else:
            rest.append(bytearray(chunk))

    async def receive(self) -> ASGIReceiveEvent:
        """uvicorn's steps (its receive hands on `self.body` alone, a bytearray to it)."""
        if self.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.waiting_for_100_continue = False
        if not self.disconnected and not self.response_complete:
            self.flow.resume_reading()
            await self.message_event.wait()
            self.message_event.clear()
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": self._taken(), "more_body": self.more_body}

    def _taken(self) -> bytes:
        """What has arrived, as one bytes object; the cycle holds none of it after."""
        body, rest = self.body, self.rest
        self.body, self.rest, self.size = b"", None, 0
        return body if rest is None else b"".join([body, *rest])

    def linger(self, protocol: Lingering) -> None:
        """Once answered, a lingering close, not a kept-alive connection."""
        self.keep_alive = False
        self.transport = _LingeringClose(self.transport, protocol)
        self.on_response = protocol.count_response

    async def send(self, message: ASGISendEvent) -> None:
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()  # uvicorn's own wait, before the check below
        if self.overtaken and self.transport.is_closing():  # its client is gone: uvicorn
            self.disconnected = True  # marks only the last parsed cycle so
        held = self.held
        if held is None:
            if message["type"] == "http.response.start":
                self.held = _HeldHead(self.transport)
                self.transport = self.held
        elif self.scope["method"] == "HEAD":
            # uvicorn writes no body for a HEAD, and its last body message completes the
            # answer (a refusal queued behind it may be written then): the head goes first.
            held.flush()
        await RequestResponseCycle.send(self, message)


@runtime_checkable
class Lingering(Protocol):
    """What an early answer needs of its connection (http/server.py's protocol)."""

    def close_lingering(self) -> None: ...

    def count_response(self) -> None: ...


class _LingeringClose(_Passing):
    """`close()` is a lingering close."""

    def __init__(self, transport: asyncio.Transport, protocol: Lingering) -> None:
        super().__init__(transport)
        self._protocol = protocol

    def close(self) -> None:
        self._protocol.close_lingering()


class EarlyAnswerCycle(Cycle):
    """A request whose body was still arriving when its handler could first run. An answer
    that starts before the body has fully arrived (413, 408, ...) ends the connection:
    `connection: close`, then a lingering close so the client can read it."""

    async def send(self, message: ASGISendEvent) -> None:
        if self.more_body and not self.response_started and not self.disconnected:
            protocol = self.transport.get_protocol()
            if isinstance(protocol, Lingering):
                self.linger(protocol)
        await super().send(message)
