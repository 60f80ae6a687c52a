"""clipserve's `/embed` under the bare protocol (bench/frontend/bare.py): what a request would cost
with an HTTP/1.1 path of clipserve's own, measured before anyone builds one.

The app is the served one (`create_app`, its lifespan: the towers, the batcher, the pipeline,
the collector's threshold), and every request runs the real `/embed` endpoint: the door's call,
`Pipeline.run`, the encoded answer, with the connection's disconnect watch in its scope as the
served protocol puts it there. Left out is everything between the socket and the endpoint:
uvicorn's protocol and cycle, the ASGI layers (the request observer, the fast lane) and their
contracts (request ids from the client, metrics by route, access lines, error pages, limits).
So the number is a lower bound on what such a path could reach, not a server to deploy.

Run as `python -m bench.frontend.direct <clipserve's flags> --host H --port P`.
"""

from __future__ import annotations

import asyncio
import http
from typing import Any

import uvloop
from starlette.routing import Route
from starlette.types import Message

from bench.frontend.bare import Bare
from clipserve.cli import build_parser
from clipserve.config import ServerConfig, load_config
from clipserve.http.app import create_app
from clipserve.http.door import InferenceEndpoint
from clipserve.http.doors import DOORS
from clipserve.http.observer import new_request_id
from clipserve.http.request import WATCH_SCOPE_KEY, DisconnectWatch
from clipserve.inference.runtime import build_runtime


def embed_endpoint() -> InferenceEndpoint:
    for door in DOORS:
        for route in door.routes():
            if isinstance(route, Route) and route.path == "/embed":
                assert isinstance(route.app, InferenceEndpoint)
                return route.app
    raise LookupError("no /embed route")


class Direct(Bare):
    """One connection; each request's body gathered, then the endpoint on a task of its own."""

    def __init__(self, state: dict[str, Any], endpoint: InferenceEndpoint) -> None:
        super().__init__()
        self.state = state
        self.endpoint = endpoint
        # The connection's going away, as the served protocol gives it (http/server.py): a
        # request's wait learns of it without a task of its own.
        self.watch = DisconnectWatch()
        self.headers: list[tuple[bytes, bytes]] = []

    def connection_lost(self, exc: Exception | None) -> None:
        self.watch.lost()

    def on_message_begin(self) -> None:
        self.headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def embed(self, body: bytes) -> None:
        asyncio.get_running_loop().create_task(self.run_endpoint(self.headers, body))

    async def run_endpoint(self, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        scope: dict[str, Any] = {
            "type": "http",
            "method": "POST",
            "path": "/embed",
            "query_string": b"",
            "headers": headers,
            "state": {**self.state, "request_id": new_request_id()},
            WATCH_SCOPE_KEY: self.watch,
        }

        given: list[bytes] = [body]

        async def receive() -> Message:
            if given:  # the body once; a disconnect is the watch's to tell
                return {"type": "http.request", "body": given.pop(), "more_body": False}
            raise RuntimeError("the body was read: the pipeline waits on the watch")

        sent: list[Message] = []

        async def send(message: Message) -> None:
            sent.append(message)

        try:
            await self.endpoint(scope, receive, send)
        except Exception:
            answer = b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n"
        else:
            start, done = sent
            status = start["status"]
            head = [b"HTTP/1.1 %d %s" % (status, http.HTTPStatus(status).phrase.encode())]
            head += [name + b": " + value for name, value in start["headers"]]
            answer = b"\r\n".join(head) + b"\r\n\r\n" + done["body"]
        self.answer(answer)


async def serve(config: ServerConfig) -> None:
    runtime = await asyncio.to_thread(build_runtime, config)
    app = create_app(config, runtime=runtime)
    endpoint = embed_endpoint()
    async with app.router.lifespan_context(app) as state:
        assert state is not None  # the app's lifespan yields its pipeline
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: Direct(dict(state), endpoint),
            config.http.host,
            config.http.port,
            backlog=2048,
        )
        async with server:
            await server.serve_forever()


def main() -> None:
    config = load_config(vars(build_parser().parse_args()))
    uvloop.run(serve(config))


if __name__ == "__main__":
    main()
