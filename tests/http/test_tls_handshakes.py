"""Failed TLS handshakes against the CLI's server: each accepted socket counts against the
socket budget until its connection is made, and a handshake that fails never makes one. They
must not add up to a budget spent for good (accepting paused, never resumed), as port
scanners and TCP health checks would make them in production."""

from __future__ import annotations

import contextlib
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from clipserve.loadgen.procs import free_port, stop
from tests.helpers import self_signed_cert, until

# A subprocess server per module (~10 s): in `make test-slow`, which CI runs.
pytestmark = pytest.mark.slow

MAX_CONNECTIONS = 4  # the socket budget: 4 + 64 sockets before accepting pauses


@pytest.fixture(scope="module")
def server(tiny_config: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("tls")
    cert, key = self_signed_cert(tmp)
    port = free_port()
    cmd = [sys.executable, "-m", "clipserve", "--backend", "fake", "--model", str(tiny_config)]
    cmd += ["--pretrained", "none", "--gpus", "cpu", "--max-connections", str(MAX_CONNECTIONS)]
    cmd += ["--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "info"]
    log = tmp / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    tls = ssl.create_default_context(cafile=cert)

    def ready() -> bool:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            return httpx.get(f"https://127.0.0.1:{port}/readyz", verify=tls).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        until(ready, 120, "the server ready over HTTPS", poll_s=0.2)
        yield f"{port} {cert}"
    finally:
        stop(proc)


@pytest.mark.parametrize("client", ["plain text", "connect and close"])
def test_failed_handshakes_do_not_spend_the_socket_budget(server: str, client: str) -> None:
    port_text, cert = server.split(" ", 1)
    port = int(port_text)
    tls = ssl.create_default_context(cafile=cert)
    for _ in range(3 * (MAX_CONNECTIONS + 64)):  # three budgets' worth, one at a time
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            if client == "plain text":  # an HTTP client on the TLS port: the handshake fails
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                with contextlib.suppress(OSError):
                    sock.recv(100)
    # A real client is still served: accepting never paused, or resumed.
    answer = httpx.get(f"https://127.0.0.1:{port}/healthz", verify=tls, timeout=10)
    assert answer.status_code == 200


def test_handshakes_left_idle_then_dropped_do_not_keep_accepting_paused(server: str) -> None:
    """Clients that connect and say nothing hold a budget's worth of sockets: accepting
    pauses, as it should. Once they are gone, nothing tells the server (no connection was
    made, and the full collection made when pausing aged their protocols): the gate's own
    collection while paused must count them out, and a client queued meanwhile is served."""
    port_text, cert = server.split(" ", 1)
    port = int(port_text)
    tls = ssl.create_default_context(cafile=cert)
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_CONNECTIONS + 66)]
    time.sleep(1.0)  # accepted, and the budget spent: accepting pauses
    for sock in idle:
        sock.close()
    answer = httpx.get(f"https://127.0.0.1:{port}/healthz", verify=tls, timeout=20)
    assert answer.status_code == 200
