"""Reads into a buffer of the thread, not a bytes object per read.

As an `asyncio.Protocol`, uvicorn's HTTP protocol gets each read as a bytes object of its own:
a tensor's 150 KB body was copied once more than it needs, and malloc'd and freed as a large
block. uvloop reads into a protocol's own buffer only when the protocol is no
`asyncio.Protocol`, which uvicorn's is; so `BufferedReads` is what the transport sees of a
connection, passing each read and event on to the HTTP protocol it holds.

One buffer per thread: a loop runs in one (tests serve from several in one process). uvloop and
asyncio call get_buffer, read into it and call buffer_updated in one step, and the parser copies
out what it keeps (httptools makes bytes of a body's chunk, the URL and each header), so nothing
refers to the buffer once buffer_updated returns.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, ClassVar, Protocol, cast

READ_BYTES = 256 * 1024  # asyncio's and uvloop's own read size
_reads = threading.local()


class Connection(Protocol):
    """What `BufferedReads` passes on to: http/server.py's `GuardedHttpProtocol`."""

    def connection_made(self, transport: asyncio.Transport) -> None: ...

    def connection_lost(self, exc: Exception | None) -> None: ...

    def eof_received(self) -> bool | None: ...

    def pause_writing(self) -> None: ...

    def resume_writing(self) -> None: ...

    def data_received(self, data: bytes) -> None: ...

    def close_lingering(self) -> None: ...

    def count_response(self) -> None: ...


def read_buffer() -> memoryview:
    """This thread's read buffer."""
    view: memoryview | None = getattr(_reads, "view", None)
    if view is None:
        view = _reads.view = memoryview(bytearray(READ_BYTES))
    return view


class BufferedReads(asyncio.BufferedProtocol):
    """A connection's protocol as the transport sees it; `inner` builds the HTTP protocol."""

    inner: ClassVar[Callable[..., Connection]]

    def __init__(self, **kwargs: Any) -> None:
        self.protocol = self.inner(**kwargs)
        self._view = read_buffer()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.protocol.connection_made(cast(asyncio.Transport, transport))

    def connection_lost(self, exc: Exception | None) -> None:
        self.protocol.connection_lost(exc)

    def eof_received(self) -> bool | None:
        return self.protocol.eof_received()

    def pause_writing(self) -> None:
        self.protocol.pause_writing()

    def resume_writing(self) -> None:
        self.protocol.resume_writing()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._view

    def buffer_updated(self, nbytes: int) -> None:
        self.protocol.data_received(self._view[:nbytes])  # type: ignore[arg-type]  # not kept

    # `Lingering` (http/cycle.py), for an early answer's cycle: it finds its protocol through
    # the transport, which has this one.

    def close_lingering(self) -> None:
        self.protocol.close_lingering()

    def count_response(self) -> None:
        self.protocol.count_response()
