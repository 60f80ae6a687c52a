"""The client tests' fixtures: the tiny model in-process as the local reference, image files on
disk, and a transport that records what the client sends and when."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from clipserve.client import Client
from tests.helpers import marked_png


def tiny_local(tiny_config: Path, tiny_checkpoint: Path) -> dict[str, Any]:
    """The arguments that make a client's local model the tiny test model."""
    return {"model": str(tiny_config), "checkpoint": str(tiny_checkpoint), "pretrained": "none"}


@pytest.fixture(scope="session")
def local_args(tiny_config: Path, tiny_checkpoint: Path) -> dict[str, Any]:
    return tiny_local(tiny_config, tiny_checkpoint)


@pytest.fixture(scope="session")
def local_client(local_args: dict[str, Any]) -> Iterator[Client]:
    """The tiny model in-process: the reference every remote answer is compared with."""
    with Client(mode="local", **local_args) as client:
        yield client


@pytest.fixture
def photos(tmp_path: Path) -> list[Path]:
    """20 distinct PNG files, photo-00.png ... photo-19.png."""
    paths = []
    for i in range(20):
        path = tmp_path / f"photo-{i:02d}.png"
        path.write_bytes(marked_png(i, seed=i))
        paths.append(path)
    return paths


@dataclass
class Exchange:
    method: str
    path: str
    headers: httpx.Headers
    body: bytes
    sent: float  # time.monotonic() when the request left
    answered: float  # ... and when its answer's headers came back
    status: int
    retry_after: str | None


@dataclass
class Recording(httpx.AsyncBaseTransport):
    """httpx's own transport, with every exchange written down: what a proxy in front of the
    server would see."""

    inner: httpx.AsyncHTTPTransport = field(default_factory=httpx.AsyncHTTPTransport)
    exchanges: list[Exchange] = field(default_factory=list)
    failures: list[tuple[str, httpx.TransportError]] = field(default_factory=list)  # no answer

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        sent = time.monotonic()
        try:
            response = await self.inner.handle_async_request(request)
        except httpx.TransportError as e:
            self.failures.append((request.url.path, e))
            raise
        self.exchanges.append(
            Exchange(
                request.method,
                request.url.path,
                request.headers,
                body,
                sent,
                time.monotonic(),
                response.status_code,
                response.headers.get("retry-after"),
            )
        )
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()

    def to(self, path: str) -> list[Exchange]:
        return [e for e in self.exchanges if e.path == path]


@dataclass
class BodyLimit(httpx.AsyncBaseTransport):
    """A proxy's body limit in front of the server, lower than the server's own: larger bodies
    get 413 in HTML naming no item, as nginx answers (client_max_body_size)."""

    limit: int
    inner: Recording = field(default_factory=Recording)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if len(await request.aread()) > self.limit:
            return httpx.Response(413, text="<html>413 Request Entity Too Large</html>")
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


@dataclass
class WrongEncoding(httpx.AsyncBaseTransport):
    """A broken proxy in front of the server: its answers to `path` say Content-Encoding gzip
    over a body that is not gzip."""

    path: str = "/embed"
    inner: httpx.AsyncHTTPTransport = field(default_factory=httpx.AsyncHTTPTransport)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.url.path != self.path:
            return response
        body = await response.aread()
        headers = {**response.headers, "content-encoding": "gzip"}
        return httpx.Response(response.status_code, headers=headers, content=body)

    async def aclose(self) -> None:
        await self.inner.aclose()


@dataclass
class ProxyPage(httpx.AsyncBaseTransport):
    """A proxy in front of the server that answers `path` itself, 200 with `body` (a captive
    portal's HTML page, or a health check's JSON)."""

    path: str = "/info"
    body: bytes = b"<html><body>Please sign in</body></html>"
    content_type: str = "text/html"
    inner: httpx.AsyncHTTPTransport = field(default_factory=httpx.AsyncHTTPTransport)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path != self.path:
            return await self.inner.handle_async_request(request)
        return httpx.Response(200, headers={"content-type": self.content_type}, content=self.body)

    async def aclose(self) -> None:
        await self.inner.aclose()
