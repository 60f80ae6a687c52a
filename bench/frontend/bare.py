"""Below the floor: the floor's answer (bench/frontend/floor.py) from a bare httptools protocol
on uvloop, with no ASGI, uvicorn or Starlette. What HTTP/1.1 itself costs a Python server on this
machine (the kernel's TCP, uvloop, httptools' C parser and the few Python calls a request needs
at the least), so the cost section can say how much of the floor is uvicorn and Starlette.

Not a server to deploy: keep-alive, Content-Length and chunked bodies, and nothing else (no
limits, no timeouts, no pipelining order beyond what one connection's reads give).

Run as `python -m bench.frontend.bare --host H --port P`.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import cast

import httptools
import uvloop

from bench.frontend.floor import ANSWER

_OK = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\ncontent-type: %s\r\n\r\n"
EMBED = _OK % (len(ANSWER), b"application/json") + ANSWER
READY = _OK % (2, b"text/plain; charset=utf-8") + b"ok"
MISSING = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"


class Bare(asyncio.Protocol):
    """One connection: each request's body gathered, then the fixed answer in one write."""

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.chunks: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's share no base class

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self.chunks)  # what a handler would read
        self.chunks = []
        if self.url == b"/embed":
            self.embed(body)
        else:
            self.answer(READY if self.url == b"/readyz" else MISSING)

    def embed(self, body: bytes) -> None:
        self.answer(EMBED)

    def answer(self, response: bytes) -> None:
        """The whole answer in one write; the connection closed after it unless kept alive."""
        assert self.transport is not None
        if self.transport.is_closing():
            return
        self.transport.write(response)
        if not self.parser.should_keep_alive():
            self.transport.close()


async def serve(host: str, port: int) -> None:
    server = await asyncio.get_running_loop().create_server(Bare, host, port, backlog=2048)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    a = parser.parse_args()
    uvloop.run(serve(a.host, a.port))


if __name__ == "__main__":
    main()
