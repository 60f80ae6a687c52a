"""Shutdown and the kernel's accept queue: a client whose connection the kernel had completed
but the server had not accepted yet, when SIGTERM came, is answered, not reset.

The server here is the real `DrainingServer` with clipserve's protocol on loopback; the test
drives its shutdown from the server's own loop without yielding after the clients connect, so
their connections are in the accept queue when it starts: exactly the state a load balancer's
requests are in at a rolling update."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

from clipserve.config import HttpConfig
from clipserve.http.guarded import FIRST_REQUEST_GRACE_S
from clipserve.http.server import build_uvicorn_config, draining_server

REQUEST = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    assert scope["type"] == "http"
    body = b"served"
    headers = [(b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def read_all(sock: socket.socket) -> bytes:
    sock.settimeout(5)
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        chunks.append(b"<reset>")
    return b"".join(chunks)


def test_connections_waiting_in_the_accept_queue_at_shutdown_are_answered() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    config = build_uvicorn_config(app, HttpConfig(), lifespan="off", log_level="warning")
    config.load()
    server = draining_server(config)
    clients: list[socket.socket] = []
    late: list[socket.socket] = []

    async def main() -> float:
        server.lifespan = config.lifespan_class(config)  # as uvicorn's serve() sets it
        await server.startup(sockets=[listener])
        # Blocking connects from the loop's own thread: the kernel completes them, the loop
        # gets no turn to accept.
        for _ in range(8):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(REQUEST)
            clients.append(sock)
        late.append(socket.create_connection(("127.0.0.1", port)))  # its request comes later
        idle = socket.create_connection(("127.0.0.1", port))  # never sends
        clients.append(idle)

        async def send_late() -> None:
            await asyncio.sleep(0.3)
            late[0].sendall(REQUEST)

        sender = asyncio.create_task(send_late())
        start = time.monotonic()
        await server.shutdown()
        await sender
        return time.monotonic() - start

    took = asyncio.run(main())
    answers = [read_all(sock) for sock in [*clients[:-1], *late]]
    for answer in answers:  # read to the end: each connection was closed after its answer
        assert answer.startswith(b"HTTP/1.1 200"), answer
        assert answer.endswith(b"\r\n\r\nserved")
    # The late one's request came once shutdown had begun: it is told the connection ends.
    assert b"connection: close" in answers[-1].lower()
    assert read_all(clients[-1]) == b""  # the idle one: closed, no answer owed
    assert took < FIRST_REQUEST_GRACE_S + 2.0
    # The listener is closed: a new client is refused, never queued behind nobody.
    refused = socket.socket()
    assert refused.connect_ex(("127.0.0.1", port)) != 0
    for sock in [*clients, *late, refused]:
        sock.close()
