"""The HTTP/1.1 connection's guards against what clients may send, with raw sockets (and curl)
against a real server: a request that asks to upgrade (its body is the parser's blind spot),
trailers, pipelining past the cap, a client that stops reading, and a client that leaves with
requests pipelined."""

from __future__ import annotations

import json
import logging
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from clipserve.http.guarded import MAX_PIPELINED
from tests.helpers import RunningServer, make_config, running, until
from tests.http.test_edge_limits import connect, error_code, read_response, read_responses

TEXT = json.dumps({"texts": ["a cat"]}).encode()
# What curl --http2 offers on plain http://
UPGRADE = b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABk\r\n"


@pytest.fixture(scope="module")
def server(tiny_config: Path, tiny_checkpoint: Path) -> Iterator[RunningServer]:
    config = make_config(
        tiny_config, tiny_checkpoint, backend="fake", linger_timeout_s=2, header_timeout_s=1
    )
    with running(config) as s:
        yield s


def text_post(body: bytes, extra: bytes = b"") -> bytes:
    head = b"POST /embed/text HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    return head + extra + b"Content-Length: %d\r\n\r\n" % len(body)


@pytest.mark.parametrize("later", [False, True], ids=["one-write", "body-later"])
def test_a_request_that_asks_to_upgrade_is_served_with_its_body_then_closed(
    server: RunningServer, later: bool
) -> None:
    with connect(server.port) as sock:
        sock.sendall(text_post(TEXT, UPGRADE))
        if later:
            time.sleep(0.3)  # the handler is reading by now
        sock.sendall(TEXT + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")  # dropped: closing
        answers = read_responses(sock)
    assert [status for status, _, _ in answers] == [200], answers
    assert answers[0][1]["connection"] == "close"
    assert len(json.loads(answers[0][2])["embeddings"][0]) > 0


def test_an_upgrade_request_read_whole_past_the_header_cap_is_served(
    server: RunningServer,
) -> None:
    # One read holds the headers and a 135 KB body: more than --max-header-bytes (64 KiB), so
    # the headers are fed up to the cap and the rest after them, which is the body's.
    body = json.dumps({"texts": ["a cat"], "padding": "x" * 135_000}).encode()
    with connect(server.port) as sock:
        sock.sendall(text_post(body, UPGRADE) + body)
        answers = read_responses(sock)
    assert [status for status, _, _ in answers] == [200], answers


def test_an_upgrade_requests_body_is_never_parsed_as_a_request(server: RunningServer) -> None:
    inner = b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n"
    with connect(server.port) as sock:
        sock.sendall(text_post(inner, UPGRADE))
        time.sleep(0.3)
        sock.sendall(inner)
        answers = read_responses(sock)
    assert [status for status, _, _ in answers] == [400], answers  # its body: not JSON
    assert error_code(answers[0][2]) == "invalid_body"


def test_a_chunked_request_that_asks_to_upgrade_is_refused(server: RunningServer) -> None:
    head = b"POST /embed/text HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    with connect(server.port) as sock:
        sock.sendall(head + UPGRADE + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
        answers = read_responses(sock)
    assert [status for status, _, _ in answers] == [400], answers
    assert error_code(answers[0][2]) == "invalid_request"


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_curl_offering_http2_on_plain_http_is_served(server: RunningServer) -> None:
    command = ["curl", "-sS", "--http2", "-H", "Content-Type: application/json"]
    command += ["--data-binary", TEXT.decode(), f"{server.url}/embed/text"]
    done = subprocess.run(command, capture_output=True, timeout=30, check=False)
    if b"does not support HTTP2" in done.stderr:
        pytest.skip("curl without HTTP/2")
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["embeddings"][0]) > 0


@pytest.mark.parametrize("split", [False, True], ids=["one-read", "trailer-later"])
def test_trailers_never_become_request_headers(server: RunningServer, split: bool) -> None:
    # No Content-Type but in a trailer: 415, however the bytes fall into reads.
    head = b"POST /embed/text HTTP/1.1\r\nHost: x\r\nX-Request-Id: from-the-headers\r\n"
    head += b"Transfer-Encoding: chunked\r\n\r\n"
    body = b"%x\r\n%s\r\n0\r\n" % (len(TEXT), TEXT)
    trailers = b"X-Request-Id: from-a-trailer\r\nContent-Type: application/json\r\n\r\n"
    with connect(server.port) as sock:
        sock.sendall(head + body)
        if split:
            time.sleep(0.2)
        sock.sendall(trailers)
        status, headers, answer = read_response(sock)
    assert status == 415, answer
    assert headers["x-request-id"] == "from-the-headers"


def test_tiny_chunks_save_up_no_allowance_for_a_long_trailer(server: RunningServer) -> None:
    head = b"POST /embed/text HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += b"Transfer-Encoding: chunked\r\n\r\n"
    chunks = b"".join(b"1\r\n%c\r\n" % byte for byte in TEXT + b" " * 20_000)
    with connect(server.port) as sock:
        sock.sendall(head)
        time.sleep(0.2)  # the body in reads of its own: framing is counted there
        sock.sendall(chunks + b"0\r\nX-Padding: ")
        time.sleep(0.2)  # the trailer in later reads; a read that ends the message is not
        sock.sendall(b"a" * 100_000)  # counted (what follows it is the next request's): a
        answers = read_responses(sock)  # trailer in one read is bounded by the read alone
    assert [status for status, _, _ in answers] == [400], answers
    assert error_code(answers[0][2]) == "invalid_request"


def test_requests_pipelined_past_the_cap_get_a_503_after_the_answers_ahead(
    server: RunningServer,
) -> None:
    count = 4 * MAX_PIPELINED
    with connect(server.port) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * count)
        answers = read_responses(sock)
    statuses = [status for status, _, _ in answers]
    assert statuses[-1] == 503 and set(statuses[:-1]) == {200}, statuses
    assert len(statuses) <= count - MAX_PIPELINED  # refused while parsing, not all queued
    assert answers[-1][1]["retry-after"] == "1"
    assert error_code(answers[-1][2]) == "overloaded"


@pytest.mark.parametrize("over", [0, 1], ids=["at-the-cap", "one-past"])
def test_the_pipelining_cap_counts_the_request_answering(server: RunningServer, over: int) -> None:
    # One write of ~2 KB is one read: every request is parsed before the first is answered.
    probe = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    last = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    with connect(server.port) as sock:
        sock.sendall(probe * (MAX_PIPELINED - 1 + over) + last)
        statuses = [status for status, _, _ in read_responses(sock)]
    assert statuses == [200] * MAX_PIPELINED + [503] * over, statuses


class Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {record.getMessage()}")


@pytest.fixture
def errors() -> Iterator[Errors]:
    """ERROR records of uvicorn's logger and ours, wherever their handlers send them."""
    handler = Errors()
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "clipserve")]
    for logger in loggers:
        logger.addHandler(handler)
    yield handler
    for logger in loggers:
        logger.removeHandler(handler)


def test_a_client_that_reads_none_of_its_answers_frees_its_connection_slot(
    tiny_config: Path, tiny_checkpoint: Path, errors: Errors
) -> None:
    """Its writes paused for --header-timeout-s (1 s here), the connection is aborted: under
    --max-connections 1 the next client is served again, not refused for as long as the
    first one likes (the keep-alive timeout, 60 s here, never comes: the answers are not
    done)."""
    flags = {"header_timeout_s": 1, "max_connections": 1, "keep_alive_timeout_s": 60}
    config = make_config(tiny_config, tiny_checkpoint, backend="fake", **flags)
    with running(config) as server:
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting
        stalled.connect(("127.0.0.1", server.port))
        stalled.setblocking(False)
        try:
            # Answers past what the kernel buffers (~3 MB on loopback), in rounds the server
            # keeps up with (its pipelining cap refuses more: that connection would close).
            for _ in range(60):
                try:
                    stalled.send(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 16)
                except (BlockingIOError, ConnectionError):
                    break  # not read any more, or cut off already
                time.sleep(0.025)
            statuses = [probe(server.port)]
            deadline = time.monotonic() + 10
            while statuses[-1] != 200 and time.monotonic() < deadline:
                time.sleep(0.25)
                statuses.append(probe(server.port))
        finally:
            stalled.close()
    assert statuses[-1] == 200, statuses
    assert errors.records == [], errors.records  # its answer was never written to the
    # closed transport (uvicorn's log keeps its records from caplog: a handler of our own)


def probe(port: int) -> int:
    with connect(port) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return read_responses(sock)[0][0]


def test_a_client_gone_with_requests_pipelined_logs_no_error(
    server: RunningServer, errors: Errors
) -> None:
    slow = text_post(TEXT) + TEXT
    before = _text_requests(server)
    for _ in range(3):
        with connect(server.port) as sock:
            sock.sendall(slow * 2)  # and gone before the first is answered
    # Each first request runs to its end (the ones behind it never start): then its errors
    # would have been logged.
    until(lambda: _text_requests(server) >= before + 3, 10, "the first requests counted")
    assert errors.records == [], errors.records


def _text_requests(server: RunningServer) -> float:
    text = httpx.get(server.url + "/metrics").text
    found = re.findall(r'^clipserve_requests_total\{route="/embed/text",[^}]*\} (\S+)$', text, re.M)
    return sum(float(n) for n in found)
