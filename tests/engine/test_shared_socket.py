"""`--workers N` serve one listening socket, bound by the supervisor and inherited by every front
end: one accept queue, which outlives any one front end. Real processes, sockets and signals.

With a socket per front end (`--reuse-port`) the kernel resets the connections queued on a dead
front end's socket, which no other front end could accept; here only the requests the dead front
end had itself accepted may fail. In exchange, `--reuse-port` spreads a burst of connections over
the front ends, which one shared accept queue does not: its last test.
"""

from __future__ import annotations

import http.client
import io
import json
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
from PIL import Image

from clipserve.loadgen.procs import free_port
from tests.engine.test_workers_served import stop_tree
from tests.helpers import self_signed_cert, until

# Multi-process servers started per test (~20 s each here): in `make test-slow`, which CI runs,
# so the default run stays near 10 minutes.
pytestmark = pytest.mark.slow

KEEP_ALIVE_CLIENTS = 32
NEW_CONNECTION_CLIENTS = 4  # each opens a connection per request
STOPPED_S = 1.0  # the victim stopped before its kill: new clients arrive meanwhile
FAILURE = (OSError, http.client.HTTPException)


def _jpeg() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 80, 160)).save(out, "JPEG")
    return out.getvalue()


JPEG = _jpeg()


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    tls: ssl.SSLContext | None = None

    def connection(self, timeout: float = 30) -> http.client.HTTPConnection:
        if self.tls is None:
            return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        return http.client.HTTPSConnection(
            "127.0.0.1", self.port, timeout=timeout, context=self.tls
        )

    def front_ends(self) -> set[int]:
        """The supervisor's children that hold the port's socket (the engine does not)."""
        found = set()
        for child in psutil.Process(self.proc.pid).children():
            try:
                if any(c.laddr.port == self.port for c in child.net_connections("tcp")):
                    found.add(child.pid)
            except psutil.NoSuchProcess:
                continue
        return found

    def accepted_by(self, pid: int) -> set[int]:
        """The client ports of the connections that front end has accepted."""
        conns = psutil.Process(pid).net_connections("tcp")
        return {c.raddr.port for c in conns if c.raddr and c.laddr.port == self.port}

    def owner(self, client_port: int) -> int | None:
        for pid in self.front_ends():
            try:
                if client_port in self.accepted_by(pid):
                    return pid
            except psutil.NoSuchProcess:
                continue
        return None

    def all_accepting(self, count: int) -> bool:
        """`count` front ends, each of which has accepted one of a few new connections (a
        front end holds the socket from its start, but accepts only once its app has)."""
        fronts = self.front_ends()
        if len(fronts) != count:
            return False
        seen: set[int | None] = set()
        for _ in range(40):
            conn = self.connection(5)
            try:
                conn.request("GET", "/healthz")
                conn.getresponse().read()
                assert conn.sock is not None
                seen.add(self.owner(conn.sock.getsockname()[1]))
            except FAILURE:
                return False
            finally:
                conn.close()
            if fronts <= seen:
                return True
        return False


@contextmanager
def workers(tiny_config: Path, tmp: Path, *extra: str) -> Iterator[Server]:
    port = free_port()
    cmd = [sys.executable, "-m", "clipserve", "--workers", "2", "--backend", "fake"]
    cmd += ["--backend-option", "latency_ms=20", "--model", str(tiny_config)]
    cmd += ["--pretrained", "none", "--gpus", "cpu", "--cache-mb", "0", "--max-queue-size", "512"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "info", *extra]
    log = tmp / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    server = Server(proc, port, log)
    if "--ssl-certfile" in extra:
        server.tls = ssl.create_default_context(cafile=extra[extra.index("--ssl-certfile") + 1])
    try:
        until(lambda: proc.poll() is None and server.all_accepting(2), 120, "2 front ends")
        yield server
    finally:
        stop_tree(proc)


@dataclass
class Load:
    """Keep-alive clients and clients that open a connection per request, each recording
    (client port, status or error) per request until stopped."""

    server: Server
    results: list[tuple[int | None, int | str]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for i in range(KEEP_ALIVE_CLIENTS + NEW_CONNECTION_CLIENTS):
            keep_alive = i < KEEP_ALIVE_CLIENTS
            thread = threading.Thread(target=self._client, args=(keep_alive,), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _client(self, keep_alive: bool) -> None:
        conn: http.client.HTTPConnection | None = None
        while not self.stop.is_set():
            port = None
            try:
                if conn is None:
                    conn = self.server.connection()
                    conn.connect()
                assert conn.sock is not None
                port = conn.sock.getsockname()[1]
                headers = {"Content-Type": "image/jpeg"}
                if not keep_alive:
                    headers["Connection"] = "close"
                conn.request("POST", "/embed", body=JPEG, headers=headers)
                response = conn.getresponse()
                response.read()
                self.results.append((port, response.status))
            except FAILURE as e:
                self.results.append((port, type(e).__name__))
                conn.close()
                conn = None
                continue
            if not keep_alive:
                conn.close()
                conn = None
        if conn is not None:
            conn.close()

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)
            assert not thread.is_alive(), "a client hung"


def test_a_killed_front_end_loses_only_the_connections_it_had_accepted(
    tiny_config: Path, tmp_path: Path
) -> None:
    """Under load, one front end is stopped (so new clients arrive while it cannot accept:
    with a socket of its own, the kernel would queue some on it) and then killed. Only the
    connections it had accepted may fail; every other one gets an answer, and keeps getting
    them while the front end restarts."""
    with workers(tiny_config, tmp_path) as server:
        load = Load(server)
        load.start()
        try:
            until(lambda: len(load.results) >= 200, 60, "the load running")
            victim = min(server.front_ends())
            stopped_at = len(load.results)
            psutil.Process(victim).suspend()
            time.sleep(STOPPED_S)  # new clients keep arriving while it cannot accept
            accepted = server.accepted_by(victim)  # frozen: a stopped process accepts nothing
            mark = len(load.results)
            psutil.Process(victim).kill()
            until(lambda: not psutil.pid_exists(victim) or _zombie(victim), 10, "victim dead")
            killed_at = len(load.results)
            # The load goes on until the restarted front end serves too.
            until(lambda: server.all_accepting(2), 120, "the front end restarted", poll_s=0.2)
            until(lambda: len(load.results) >= killed_at + 200, 60, "load after the kill")
        finally:
            load.finish()
    failed = [(port, r) for port, r in load.results if not isinstance(r, int)]
    lost = [(port, r) for port, r in failed if port not in accepted]
    assert not lost, f"{len(lost)} connections the dead front end never accepted failed: {lost}"
    assert len(failed) <= len(accepted)
    statuses = {r for _, r in load.results if isinstance(r, int)}
    assert statuses <= {200, 503}, statuses
    # The run was what it says: the other front end answered while the victim was stopped,
    # and both after its restart.
    assert any(isinstance(r, int) for _, r in load.results[stopped_at:mark])
    assert sum(isinstance(r, int) for _, r in load.results[killed_at:]) >= 200 - len(failed)
    assert "Traceback" not in server.log.read_text()


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_tls_with_two_front_ends_on_the_shared_socket(tiny_config: Path, tmp_path: Path) -> None:
    cert, key = self_signed_cert(tmp_path)
    tls = ["--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
    with workers(tiny_config, tmp_path, *tls) as server:
        assert server.tls is not None
        assert _listening(server.port) == 1  # one socket, both front ends accepting on it
        # all_accepting saw both front ends accept a TLS connection and answer on it.
        conn = server.connection()
        conn.request("POST", "/embed", body=JPEG, headers={"Content-Type": "image/jpeg"})
        response = conn.getresponse()
        body = json.loads(response.read())
        conn.close()
        assert response.status == 200, body
        assert len(body["embedding"]) == json.loads(tiny_config.read_text())["embed_dim"]


def _listening(port: int) -> int:
    """Listening sockets on `port` (/proc/net/tcp, state 0A): one shared, or one per front
    end; a bound socket that does not listen (the supervisor's) is not among them."""
    rows = [ln.split() for ln in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return sum(1 for r in rows if r[1].endswith(f":{port:04X}") and r[3] == "0A")


def _spread(server: Server, count: int = 64) -> list[int]:
    """Connections each front end accepted of `count` opened at once (one request on each)."""
    conns = [server.connection(10) for _ in range(count)]
    try:
        for conn in conns:
            conn.request("GET", "/healthz")
        for conn in conns:
            response = conn.getresponse()
            response.read()
            assert response.status == 200
        return sorted(len(server.accepted_by(pid)) for pid in server.front_ends())
    finally:
        for conn in conns:
            conn.close()


def test_reuse_port_spreads_connections_and_a_restarted_front_end_rejoins(
    tiny_config: Path, tmp_path: Path
) -> None:
    """`--reuse-port`: 64 connections opened at once land on both front ends (the kernel's hash:
    fewer than 12 on one has a chance of ~1e-7). After kill -9 of one, new connections all reach
    the other (the dead socket leaves the group); the restarted one takes its share again."""
    with workers(tiny_config, tmp_path, "--reuse-port") as server:
        assert _listening(server.port) == 2  # a socket of each front end's own
        first = _spread(server)
        assert len(first) == 2 and min(first) >= 12, first
        victim = min(server.front_ends())
        psutil.Process(victim).kill()
        # Reaped by the supervisor, not only a zombie: a zombie leader's other threads may still
        # hold its socket open, and a connection the kernel queues there meanwhile is reset
        # (the cost --reuse-port's help states).
        until(lambda: not psutil.pid_exists(victim), 10, "victim reaped")
        for _ in range(20):
            conn = server.connection(10)
            try:
                conn.request("GET", "/healthz")
                assert conn.getresponse().status == 200
            finally:
                conn.close()
        until(lambda: server.all_accepting(2), 120, "the front end restarted", poll_s=0.2)
        again = _spread(server)
        assert len(again) == 2 and min(again) >= 12, again
        assert _listening(server.port) == 2
    assert "Traceback" not in server.log.read_text()


def test_reuse_port_drains_each_front_ends_own_socket(tiny_config: Path, tmp_path: Path) -> None:
    """SIGTERM with requests in flight on both front ends' sockets: each is answered, the tree
    exits 0, and nothing is left listening on the port."""
    with workers(tiny_config, tmp_path, "--reuse-port", "--backend-option", "latency_ms=200") as s:
        conns = [s.connection(30) for _ in range(16)]
        try:
            for conn in conns:
                conn.connect()
            ports = [c.sock.getsockname()[1] for c in conns if c.sock is not None]

            def owners() -> set[int | None]:
                return {s.owner(port) for port in ports}

            until(lambda: None not in owners(), 10, "every connection accepted")
            assert len(owners()) == 2, owners()  # 16 by hash on 2 sockets: all on one, p ~ 3e-5
            assert _listening(s.port) == 2
            with ThreadPoolExecutor(len(conns)) as pool:
                futures = [pool.submit(_post, c) for c in conns]
                time.sleep(0.1)  # in flight: the fake device takes 200 ms a batch
                s.proc.send_signal(signal.SIGTERM)
                statuses = [f.result() for f in futures]
        finally:
            for conn in conns:
                conn.close()
        assert statuses == [200] * len(conns)
        assert s.proc.wait(60) == 0
        assert _listening(s.port) == 0
    assert "Traceback" not in s.log.read_text()


def _post(conn: http.client.HTTPConnection) -> int:
    conn.request("POST", "/embed", body=JPEG, headers={"Content-Type": "image/jpeg"})
    response = conn.getresponse()
    response.read()
    return response.status
