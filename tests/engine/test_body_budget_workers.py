"""--max-body-bytes-in-flight holds across the front ends of `clipserve --workers 2`: bodies
stalled on both front ends fill it, then the next body is refused 503 on either front end; the
budget comes back when they end, and when a front end holding some is killed."""

from __future__ import annotations

import http.client
import io
import os
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from PIL import Image

from clipserve.loadgen.procs import free_port, stop
from tests.helpers import until

# Multi-process servers started per test (~20 s each here): in `make test-slow`, which CI runs,
# so the default run stays near 10 minutes.
pytestmark = pytest.mark.slow

FRONT_ENDS = 2
STALL = 256 * 1024  # body bytes each stalled request sends before it stops
BUDGET = 4 * STALL  # --max-body-bytes-in-flight: four stalled bodies, wherever they are


class Served:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.proc, self.port, self.log = proc, port, log

    def front_ends(self) -> list[int]:
        found = []
        for child in psutil.Process(self.proc.pid).children():
            try:
                conns = child.net_connections(kind="tcp")
            except psutil.NoSuchProcess:
                continue
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == self.port for c in conns):
                found.append(child.pid)
        return found

    def owner(self, sock: socket.socket) -> int:
        local = sock.getsockname()[1]

        def holder() -> int | None:
            for pid in self.front_ends():
                for c in psutil.Process(pid).net_connections(kind="tcp"):
                    if c.raddr and c.raddr.port == local and c.laddr.port == self.port:
                        return pid
            return None

        return until(holder, 5, "a front end holding the connection")

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=20)


@pytest.fixture(scope="module")
def served(tiny_config: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    port = free_port()
    log = tmp_path_factory.mktemp("budget") / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "clipserve",
        *("--workers", str(FRONT_ENDS), "--backend", "fake", "--model", str(tiny_config)),
        *("--pretrained", "none", "--gpus", "cpu", "--host", "127.0.0.1", "--port", str(port)),
        *("--max-body-bytes", str(BUDGET), "--max-body-bytes-in-flight", str(BUDGET)),
        *("--request-timeout-s", "60", "--log-level", "info"),
    ]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    server = Served(proc, port, log)
    try:

        def ready() -> bool:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                return embed(server)[0] == 200 and len(server.front_ends()) == FRONT_ENDS
            except OSError:
                return False

        until(ready, 120, "both front ends serving", poll_s=0.3)
        yield server
    finally:
        stop(proc)


def _png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 80, 20)).save(out, "PNG")
    return out.getvalue()


PNG = _png()


def embed(server: Served) -> tuple[int, dict[str, str], bytes, int]:
    """A small image on a new connection: status, headers, body, and the front end's pid."""
    with server.connect() as sock:
        pid = server.owner(sock)
        conn = http.client.HTTPConnection("127.0.0.1", server.port)
        conn.sock = sock
        conn.request("POST", "/embed", body=PNG, headers={"Content-Type": "image/png"})
        response = conn.getresponse()
        headers = {k.lower(): v for k, v in response.getheaders()}
        return response.status, headers, response.read(), pid


def budget_table(served: Served) -> list[tuple[int, int]]:
    """(pid, bytes held) of each front end's slot in the shared body budget."""
    from clipserve.http.body_budget import budget_path

    data = budget_path(served.proc.pid).read_bytes()
    return [struct.unpack_from("<qq", data, 16 * i) for i in range(FRONT_ENDS)]


def stall(sock: socket.socket) -> None:
    head = b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
    sock.sendall(head + b"Content-Length: %d\r\n\r\n" % BUDGET + b"\0" * STALL)


def test_stalled_bodies_on_both_front_ends_fill_one_budget(served: Served) -> None:
    # Two stalled bodies on each front end: half the budget each, all of it together.
    held: dict[int, list[socket.socket]] = {}
    extra: list[socket.socket] = []
    try:
        while sum(len(s) for s in held.values()) < 4:
            sock = served.connect()
            pid = served.owner(sock)
            if len(held.setdefault(pid, [])) < 2:
                stall(sock)
                held[pid].append(sock)
            else:
                extra.append(sock)  # kept open, so the kernel sends the next one elsewhere
        assert len(held) == FRONT_ENDS
        refused: dict[int, dict[str, str]] = {}

        def refused_on_both() -> bool:
            status, headers, body, pid = embed(served)
            if status == 503:
                assert b"--max-body-bytes-in-flight" in body, body
                refused[pid] = headers
            return len(refused) == FRONT_ENDS

        until(refused_on_both, 30, "a 503 from each front end", poll_s=0.05)
        assert all(h.get("retry-after") for h in refused.values()), refused

        # A front end killed with its stalled bodies: their bytes stop counting (its slot is
        # zeroed by its successor, or dropped as dead), so both serve again.
        victim = next(iter(held))
        for sock in held.pop(victim):
            sock.close()
        os.kill(victim, signal.SIGKILL)
        for sock in extra:
            sock.close()
        extra.clear()

        # Replaced; a connection the kernel had queued on the dead one is item 3's, not ours.
        def replaced() -> bool:
            fronts = served.front_ends()
            return len(fronts) == FRONT_ENDS and victim not in fronts

        until(replaced, 60, "the front end replaced", poll_s=0.2)
        served_by: set[int] = set()

        def serves_again() -> bool:
            status, _, _, pid = embed(served)
            if status == 200:
                served_by.add(pid)
            return len(served_by) == FRONT_ENDS

        until(serves_again, 60, "both front ends serving bodies again", poll_s=0.1)
    finally:
        for sock in [*extra, *(s for socks in held.values() for s in socks)]:
            sock.close()


def test_budget_comes_back_when_stalled_bodies_end(served: Served) -> None:
    socks = [served.connect() for _ in range(4)]
    try:
        for sock in socks:
            stall(sock)
        try:
            until(lambda: embed(served)[0] == 503, 30, "the budget full", poll_s=0.05)
        except AssertionError as e:  # what each front end holds, and what its log says
            raise AssertionError(
                f"{e}: {budget_table(served)}\n{served.log.read_text()[-4000:]}"
            ) from None
    finally:
        for sock in socks:
            sock.close()
    served_by: set[int] = set()

    def serves() -> bool:
        status, _, _, pid = embed(served)
        if status == 200:
            served_by.add(pid)
        return len(served_by) == FRONT_ENDS

    until(serves, 30, "both front ends serving again", poll_s=0.05)
