"""Connection-level limits against a real server, driven with raw sockets and urllib.

Every limit is set small here so each case resolves in about a second.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from clipserve.http.probes import asks_probe
from tests.helpers import (
    PNG,
    RunningServer,
    Serve,
    make_config,
    model_name,
    png_bytes,
    random_pixels,
    running,
    until,
)

LIMITS = {
    "backend": "fake",
    "max_header_bytes": 16384,
    "header_timeout_s": 0.5,
    "keep_alive_timeout_s": 0.5,
    "linger_timeout_s": 2,
    "request_timeout_s": 1.0,
    "max_body_bytes": 1024 * 1024,
}


@pytest.fixture(scope="module")
def server(tiny_config: Path, tiny_checkpoint: Path) -> Iterator[RunningServer]:
    with running(make_config(tiny_config, tiny_checkpoint, **LIMITS)) as s:
        yield s


OPEN: list[socket.socket] = []  # raw client sockets of the running test


@pytest.fixture(autouse=True)
def _close_sockets() -> Iterator[None]:
    yield
    while OPEN:
        OPEN.pop().close()


def connect(server: RunningServer, timeout: float = 3.0) -> socket.socket:
    """A raw client socket, closed when the test ends."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=timeout)
    OPEN.append(sock)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    response = http.client.HTTPResponse(sock)
    response.begin()
    headers = {k.lower(): v for k, v in response.getheaders()}
    return response.status, headers, response.read()


def healthz_status(server: RunningServer) -> int:
    sock = connect(server)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
    return read_response(sock)[0]


def error_code(body: bytes) -> str:
    return str(json.loads(body)["error"]["code"])


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """True if the server closes the connection within `seconds` (EOF or reset)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def test_huge_header_is_refused_fast_and_healthz_stays_responsive(server: RunningServer) -> None:
    sock = connect(server)
    t0 = time.monotonic()
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Big: ")

    def stream() -> None:  # 1 MiB of one header value, as fast as the server takes it
        try:
            for _ in range(16):
                sock.sendall(b"a" * 65536)
        except OSError:
            pass

    sender = threading.Thread(target=stream)
    sender.start()
    started = time.monotonic()
    assert httpx.get(server.url + "/healthz", timeout=5).status_code == 200
    assert time.monotonic() - started < 1.0
    status, headers, body = read_response(sock)
    sender.join()
    assert status == 431 and error_code(body) == "headers_too_large", body
    assert b"--max-header-bytes" in body and headers["content-type"] == "application/json"
    assert time.monotonic() - t0 < 2.0
    assert closed_within(sock, 3)


def test_header_just_under_the_limit_is_served(server: RunningServer) -> None:
    sock = connect(server)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 15000 + b"\r\n\r\n")
    assert read_response(sock)[0] == 200


def test_connection_that_sends_nothing_is_closed_after_the_header_timeout(
    server: RunningServer,
) -> None:
    sock = connect(server)
    t0 = time.monotonic()
    assert closed_within(sock, 3)
    assert 0.4 < time.monotonic() - t0 < 2.0


def test_headers_dripped_slowly_get_408_and_a_close(server: RunningServer) -> None:
    sock = connect(server)
    stop = threading.Event()

    def drip() -> None:
        try:
            sock.sendall(b"GET /healthz HTTP/1.1\r\n")
            while not stop.wait(0.1):
                sock.sendall(b"X-Drip: 1\r\n")
        except OSError:
            pass

    dripper = threading.Thread(target=drip)
    t0 = time.monotonic()
    dripper.start()
    try:
        status, headers, body = read_response(sock)
    finally:
        stop.set()
        dripper.join()
    assert status == 408 and error_code(body) == "header_timeout", body
    assert headers["connection"] == "close"
    assert time.monotonic() - t0 < 1.5
    assert closed_within(sock, 3)


def test_malformed_request_gets_a_json_400(server: RunningServer) -> None:
    sock = connect(server)
    sock.sendall(b"NOT AN HTTP REQUEST\r\n\r\n")
    status, _, body = read_response(sock)
    assert status == 400 and error_code(body) == "invalid_request", body
    assert closed_within(sock, 3)


def test_urllib_sending_an_oversized_body_reads_the_413(server: RunningServer) -> None:
    # urllib sends the whole body before it reads anything; a plain close resets the connection
    # and the client never sees why.
    request = urllib.request.Request(
        server.url + "/embed",
        data=b"\0" * (16 * 1024 * 1024),
        headers=PNG,
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 413
    assert error_code(refused.value.read()) == "payload_too_large"


STALLED_BODIES = {  # each door's inference route, its media type, and whether it has a code
    "native": (b"/embed", b"image/png", True),
    "openai": (b"/v1/embeddings", b"application/json", True),
    "kserve": (b"/v2/models/{name}/infer", b"application/json", False),
}


@pytest.mark.parametrize("door", list(STALLED_BODIES))
def test_a_body_still_arriving_at_the_deadline_gets_408_and_the_connection_closes(
    server: RunningServer, door: str
) -> None:
    """The client's delay, not the server's: 408 (RFC 9110: the request did not arrive in
    time), in the door's own error shape, and the connection closes. Not a 504, a server's."""
    path, media, coded = STALLED_BODIES[door]
    path = path.replace(b"{name}", model_name(server).encode())
    sock = connect(server)
    sock.sendall(
        b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: %s\r\n"
        b"Content-Length: 100000\r\n\r\n" % (path, media) + b"\x89PNG" * 4
    )
    status, headers, body = read_response(sock)
    assert status == 408, body
    if coded:  # {"error": {"code", ...}}, the native and OpenAI shapes
        assert error_code(body) == "body_timeout", body
    else:  # KServe's shape: the message alone
        assert json.loads(body)["error"].startswith("request body not received within 1 s"), body
    assert headers["connection"] == "close"
    assert closed_within(sock, 2.5)


def test_keep_alive_survives_complete_requests(server: RunningServer) -> None:
    sock = connect(server)
    image = png_bytes(random_pixels(3))
    for _ in range(2):
        sock.sendall(
            b"POST /embed HTTP/1.1\r\nHost: t\r\nContent-Type: image/png\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(image), image)
        )
        status, headers, body = read_response(sock)
        assert status == 200 and "connection" not in headers, body
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
    assert read_response(sock)[0] == 200


def test_idle_kept_alive_connection_is_closed_after_the_keep_alive_timeout(
    server: RunningServer,
) -> None:
    sock = connect(server)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
    assert read_response(sock)[0] == 200
    t0 = time.monotonic()
    assert closed_within(sock, 3)
    assert time.monotonic() - t0 < 1.5


def test_connections_over_the_cap_are_refused_fast_and_logged(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    server = serve(backend="fake", max_connections=4, header_timeout_s=10, linger_timeout_s=1)
    caplog.set_level(logging.WARNING, logger="clipserve")
    held = []
    for _ in range(4):  # each proven accepted: it was answered, and stays open (keep-alive)
        sock = connect(server)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        assert read_response(sock)[0] == 200
        held.append(sock)
    t0 = time.monotonic()
    refused = connect(server)
    refused.sendall(b"GET /info HTTP/1.1\r\nHost: t\r\n\r\n")
    status, headers, body = read_response(refused)
    assert status == 503 and error_code(body) == "overloaded", body
    assert headers["retry-after"] == "1" and b"--max-connections" in body
    assert headers["x-request-id"]
    assert time.monotonic() - t0 < 0.5
    assert closed_within(refused, 3)
    assert any("--max-connections" in r.getMessage() for r in caplog.records), caplog.text
    held.pop().close()
    # The freed slot is taken by the next client.
    until(lambda: healthz_status(server) == 200, 3, "a closed connection freeing its slot", 0.05)


def test_probes_and_scrapes_past_the_cap_are_served_and_the_rest_refused(serve: Serve) -> None:
    """A replica full of connections is busy, not dead: its liveness and readiness probes and
    Prometheus's scrape are answered (then the connection closes); other requests, a request
    line that never ends and a connection that sends nothing get the 503, each counted."""
    server = serve(backend="fake", max_connections=2, header_timeout_s=10, linger_timeout_s=1)
    for _ in range(2):
        sock = connect(server)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        assert read_response(sock)[0] == 200
    for method, path in [("GET", "/healthz"), ("HEAD", "/readyz"), ("GET", "/v2/health/ready")]:
        sock = connect(server)
        sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
        response = http.client.HTTPResponse(sock, method=method)
        response.begin()
        assert response.status == 200, (method, path, response.read())
        assert response.getheader("connection") == "close"
    split = connect(server)  # the request line in two writes
    split.sendall(b"GET /metr")
    time.sleep(0.2)
    split.sendall(b"ics?x=1 HTTP/1.1\r\nHost: t\r\n\r\n")
    status, _, body = read_response(split)
    assert status == 200 and b"clipserve_connections_refused_total 0.0" in body, body[:200]
    refusals = [
        b"POST /embed/text HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\n{}",
        b"GET /healthzz HTTP/1.1\r\nHost: t\r\n\r\n",
        b"GET /" + b"a" * 9000,  # no line end within the request line's cap
        b"",  # nothing: refused after the wait
    ]
    for sent in refusals:
        sock = connect(server)
        sock.sendall(sent)
        status, _, body = read_response(sock)
        assert status == 503 and error_code(body) == "overloaded", (sent[:40], body)
    slow = connect(server)  # a probe's line, then no headers: it is past the cap all the same
    t0 = time.monotonic()
    slow.sendall(b"GET /healthz HTTP/1.1\r\n")
    status, _, body = read_response(slow)
    assert status == 503 and time.monotonic() - t0 < 3, body  # not --header-timeout-s (10)
    sock = connect(server)
    sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n")
    _, _, body = read_response(sock)
    assert b"clipserve_connections_refused_total 5.0" in body
    assert b'clipserve_requests_total{route="other",status="503"} 5.0' in body


@pytest.mark.parametrize(
    ("head", "probe"),
    [
        (b"GET /healthz HTTP/1.1\r\nHost: t\r\n", True),
        (b"HEAD /v2/health/ready HTTP/1.1\r\n", True),
        (b"GET /metrics?name[]=x HTTP/1.0\r\n", True),
        (b"\r\nGET /readyz HTTP/1.1\n", True),  # an empty line first; a bare LF
        (b"GET /healthz", None),  # the line not ended yet
        (b"\r\n", None),
        (b"POST /healthz HTTP/1.1\r\n", False),
        (b"GET /healthzz HTTP/1.1\r\n", False),
        (b"GET /healthz\r\n", False),  # HTTP/0.9
        (b"GET /" + b"a" * 9000, False),  # no end within the cap
    ],
)
def test_a_probe_is_told_from_its_request_line(head: bytes, probe: bool | None) -> None:
    assert asks_probe(head) is probe
