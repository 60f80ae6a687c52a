"""`bench/frontend/bare.py`, the protocol below the floor: it must answer what the floor
answers, over keep-alive, pipelined and chunked requests, or its CPU per request measures
something else; `bench/frontend/direct.py`, clipserve's endpoint under it; the page faults
the cost section counts."""

from __future__ import annotations

import contextlib
import http.client
import json
import mmap
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import uvloop

from bench.frontend.bare import Bare
from bench.frontend.cli import FAKE_CONFIG
from bench.frontend.floor import ANSWER
from bench.frontend.load import requests_of
from bench.frontend.servers import fake_flags, tree_faults
from clipserve.loadgen.procs import free_port, wait_ready

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def port() -> Iterator[int]:
    loop = uvloop.new_event_loop()
    sock = socket.create_server(("127.0.0.1", 0))
    server = loop.run_until_complete(loop.create_server(Bare, sock=sock))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield sock.getsockname()[1]
    finally:
        loop.call_soon_threadsafe(server.close)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_answers_the_floors_body_on_a_kept_alive_connection(port: int) -> None:
    with contextlib.closing(http.client.HTTPConnection("127.0.0.1", port, timeout=5)) as conn:
        _ask(conn)


def _ask(conn: http.client.HTTPConnection) -> None:
    for body in (b"x" * 150_528, b"", b"y"):
        conn.request("POST", "/embed", body=body)
        answer = conn.getresponse()
        assert (answer.status, answer.read()) == (200, ANSWER)
    conn.request("GET", "/readyz")
    assert conn.getresponse().read() == b"ok"
    conn.request("GET", "/elsewhere")
    assert conn.getresponse().status == 404


def test_pipelined_and_chunked_requests(port: int) -> None:
    chunked = b"POST /embed HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
    chunked += b"3\r\nabc\r\n0\r\n\r\n"
    plain = b"POST /embed HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi"
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(chunked + plain)
        received = b""
        while received.count(ANSWER) < 2:
            data = s.recv(65536)
            assert data, "closed before both answers"
            received += data
    assert received.count(b"HTTP/1.1 200 OK") == 2


def test_a_malformed_request_closes_the_connection(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        assert s.recv(100) == b""


@pytest.mark.slow
def test_direct_serves_embed_through_the_served_pipeline(tmp_path: Path) -> None:
    """bench/frontend/direct.py answers /embed as clipserve does (a 512-float row from the fake),
    or the cost section would time something else."""
    model = tmp_path / "fake-512.json"
    model.write_text(json.dumps(FAKE_CONFIG))
    port = free_port()
    argv = [sys.executable, "-m", "bench.frontend.direct", *fake_flags(model)]
    argv += ["--cache-mb", "0", "--log-level", "warning", "--port", str(port)]
    with subprocess.Popen(argv, cwd=REPO) as proc:
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(proc, url, 120, "direct")
            tensor = requests_of("raw-tensor")[0]
            ask = urllib.request.Request(url + "/embed", tensor.body, tensor.headers)
            with urllib.request.urlopen(ask, timeout=10) as answer:
                rows = json.loads(answer.read())["embeddings"]
            assert answer.status == 200
            assert "queue;dur=" in answer.headers["server-timing"]
            assert [len(row) for row in rows] == [512]
        finally:
            proc.terminate()


def test_tree_faults_counts_new_pages() -> None:
    """The cost section's page faults a request: touching 16 MiB of fresh memory faults each
    of its 4 KiB pages once."""
    me = psutil.Process()
    before = tree_faults(me)
    fresh = mmap.mmap(-1, 16 << 20)
    for offset in range(0, len(fresh), 4096):
        fresh[offset] = 1
    fresh.close()
    assert tree_faults(me) - before >= (16 << 20) // 4096
