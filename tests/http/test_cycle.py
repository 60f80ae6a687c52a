"""The request-response cycle under clipserve's uvicorn settings (http/cycle.py), over raw
sockets against a real server: bodies however they arrive, an answer's head sent with its
body, and the answers that have no body or stop after their head."""

from __future__ import annotations

import asyncio
import hashlib
import socket
import time
from collections.abc import Iterator

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from clipserve.config import HttpConfig
from clipserve.http.server import build_uvicorn_config
from clipserve.loadgen.procs import free_port
from tests.helpers import uvicorn_thread

PAUSE_S = 0.4  # between an answer's head and its body, in the slow answers
HOLD_S = 1.5  # before /hold reads its body


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """Echoes what it read of the body (size, sha256, chunks); other paths answer in the shape
    their name says."""
    if scope["type"] != "http":
        return
    path = scope["path"]
    if path == "/stop-after-head":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        return
    if path == "/raise-after-head":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("after the head")
    if path == "/hold":  # reads nothing for a while: the server must stop reading too
        await asyncio.sleep(HOLD_S)
    body, chunks, more = b"", 0, True
    while more:
        message = await receive()
        assert message["type"] == "http.request"
        assert type(message["body"]) is bytes
        body += message["body"]
        chunks += 1
        more = message.get("more_body", False)
    answer = b"%d %s %d" % (len(body), hashlib.sha256(body).hexdigest().encode(), chunks)
    if path == "/no-content":
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    if path == "/stream":  # no content-length: chunked, three writes apart
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for part in (b"one", b"two", b"three"):
            await asyncio.sleep(PAUSE_S)
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    headers = [(b"content-length", b"%d" % len(answer)), (b"content-type", b"text/plain")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    if path == "/slow-body":
        await asyncio.sleep(PAUSE_S)
    await send({"type": "http.response.body", "body": answer})


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    config = build_uvicorn_config(app, HttpConfig(), host="127.0.0.1", port=free_port())
    with uvicorn_thread(uvicorn.Server(config)):
        yield config.port


def request(path: str, body: bytes, method: str = "POST", extra: str = "") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n{extra}\r\n"
    return head.encode() + body


def read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(1 << 20):
        data += chunk
    return data


def echo(body: bytes, chunks: int) -> bytes:
    return b"%d %s %d" % (len(body), hashlib.sha256(body).hexdigest().encode(), chunks)


@pytest.mark.parametrize("size", [0, 1, 70_000, 3_000_000])  # 70 KB: past uvicorn's high water
def test_a_body_sent_at_once_is_read_whole(port: int, size: int) -> None:
    body = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request("/", body, extra="connection: close\r\n"))
        answer = read_all(sock)
    head, _, got = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert got.split()[:2] == echo(body, 1).split()[:2]


def test_a_body_that_arrives_in_pieces_is_read_in_order(port: int) -> None:
    body = bytes(range(256)) * 400
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        head = request("/", body, extra="connection: close\r\n")[: -len(body)]
        sock.sendall(head + body[:1000])
        for start in range(1000, len(body), 30_000):
            time.sleep(0.05)
            sock.sendall(body[start : start + 30_000])
        answer = read_all(sock)
    size_read, digest, chunks = answer.partition(b"\r\n\r\n")[2].split()
    assert [size_read, digest] == echo(body, 1).split()[:2]
    assert int(chunks) >= 2  # the app did see it in pieces


def test_a_body_the_app_does_not_read_yet_stays_in_the_socket(port: int) -> None:
    """Reading pauses past uvicorn's high-water mark: what the server holds is bounded by the
    sockets' buffers, not by the body (32 MB here)."""
    body = b"z" * (32 << 20)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.setblocking(False)
        data = memoryview(request("/hold", body))
        sent, start = 0, time.monotonic()
        while time.monotonic() - start < HOLD_S * 0.6 and sent < len(data):
            try:
                sent += sock.send(data[sent : sent + (1 << 20)])
            except BlockingIOError:
                time.sleep(0.01)
        assert sent < len(data) // 2, sent  # the rest waits in the client
        sock.setblocking(True)
        sock.sendall(data[sent:])
        assert read_one(sock).split()[:2] == echo(body, 1).split()[:2]


def test_chunked_and_expect_continue_bodies(port: int) -> None:
    body = b"a" * 5000 + b"b" * 7000
    framed = b"1388\r\n" + body[:5000] + b"\r\n1b58\r\n" + body[5000:] + b"\r\n0\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n" + framed)
        assert echo(body, 1).split()[:2] == read_one(sock).split()[:2]
        sock.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n")
        sock.sendall(b"expect: 100-continue\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(b"hello")
        assert read_one(sock).split()[:2] == echo(b"hello", 1).split()[:2]


def read_one(sock: socket.socket) -> bytes:
    """One content-length answer's body from a kept-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, rest = data.partition(b"\r\n\r\n")
    size = int(
        next(
            v
            for k, _, v in (h.partition(b": ") for h in head.split(b"\r\n")[1:])
            if k == b"content-length"
        )
    )
    while len(rest) < size:
        rest += sock.recv(65536)
    return rest


def test_an_answers_head_is_sent_with_its_body(port: int) -> None:
    """The head waits for the body (one write): nothing arrives before the body is sent."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sent = time.monotonic()
        sock.sendall(request("/slow-body", b"abc"))
        first = sock.recv(65536)
        waited = time.monotonic() - sent
    assert waited >= PAUSE_S * 0.9, first
    head, _, rest = first.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and rest == echo(b"abc", 1)


def test_a_streamed_answer_goes_out_chunk_by_chunk(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request("/stream", b"", extra="connection: close\r\n"))
        arrivals = []
        data = b""
        while chunk := sock.recv(65536):
            arrivals.append(time.monotonic())
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head
    assert rest == b"3\r\none\r\n3\r\ntwo\r\n5\r\nthree\r\n0\r\n\r\n"
    assert arrivals[-1] - arrivals[0] >= PAUSE_S * 1.5  # not held to the end


@pytest.mark.parametrize(
    ("method", "path", "status"), [("HEAD", "/", 200), ("POST", "/no-content", 204)]
)
def test_answers_without_a_body_are_sent(port: int, method: str, path: str, status: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request(path, b"", method=method))
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        assert data.startswith(b"HTTP/1.1 %d" % status)
        # and the connection is still kept alive for the next request
        sock.sendall(request("/", b"next"))
        assert read_one(sock) == echo(b"next", 1)


def test_a_heads_answer_precedes_the_refusal_of_bad_bytes_behind_it(port: int) -> None:
    """A HEAD's head goes out before its answer completes: the parser's 400 for the bytes
    pipelined after it is written as that answer completes, and must come second."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request("/", b"", method="HEAD") + b"BOGUS\x01 junk\r\n\r\n")
        data = read_all(sock)
    assert data.startswith(b"HTTP/1.1 200"), data
    assert b"HTTP/1.1 400" in data.partition(b"\r\n\r\n")[2], data


@pytest.mark.parametrize("path", ["/stop-after-head", "/raise-after-head"])
def test_an_app_that_stops_after_its_head_still_sends_it(port: int, path: str) -> None:
    """uvicorn closes such a connection; the head sent before that reaches the client."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request(path, b""))
        assert read_all(sock).startswith(b"HTTP/1.1 200")


def test_a_cycle_hands_on_one_chunk_as_it_came_and_joins_several_once() -> None:
    """The body's bytes as the parser made them: one chunk is handed on as that very object
    (no copy); several become one bytes object, in order; the count that flow control reads
    is what is held, and nothing is held once handed on."""
    from clipserve.http.cycle import Cycle

    cycle = Cycle.__new__(Cycle)  # its state is what `adopt` sets; no connection needed
    cycle.adopt()
    one = bytes(range(256)) * 300
    cycle.take(one)
    assert cycle.size == len(one)
    assert cycle._taken() is one
    assert cycle.size == 0
    parts = [b"a" * 65_536, b"b" * 65_536, b"c" * 19_456]
    for part in parts:
        cycle.take(part)
    assert cycle.size == sum(map(len, parts))
    got = cycle._taken()
    assert type(got) is bytes and got == b"".join(parts)
    assert (cycle.size, cycle._taken()) == (0, b"")


def test_a_body_in_tiny_chunks_is_held_as_its_bytes_not_an_object_each() -> None:
    """A chunked body of 2-byte chunks (each within the framing allowance): the cycle keeps
    them in one bytearray, not 50,000 objects (~35 bytes each beyond the 2 that flow control
    counts); large chunks between them keep their place in the order."""
    from clipserve.http.cycle import SMALL_CHUNK, Cycle

    cycle = Cycle.__new__(Cycle)
    cycle.adopt()
    sent = [b"%02d" % (i % 100) for i in range(50_000)]
    big = b"B" * SMALL_CHUNK
    sent[10_000:10_000] = [big]
    sent[30_000:30_000] = [big, big]
    for chunk in sent:
        cycle.take(chunk)
    assert cycle.rest is not None and len(cycle.rest) <= 6  # small runs, the big ones apart
    assert cycle.size == sum(map(len, sent))
    assert cycle._taken() == b"".join(sent)
