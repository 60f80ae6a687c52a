"""`--workers N`: real processes (supervisor, engine, front ends) on a loopback port.

One server serves the whole module, in order: batching across front ends, global admission,
summed metrics, a killed front end, a killed engine, and last the SIGTERM drain and cleanup.
A connection stays with the front end that accepted it from the port's one shared socket; psutil
tells which front end holds which connection, so the tests know where each request went.
"""

from __future__ import annotations

import http.client
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgpack
import psutil
import pytest
from PIL import Image

from clipserve.engine.slots import shm_dir
from clipserve.loadgen.procs import free_port
from tests.helpers import until

LATENCY_MS = 150  # the fake device's time per batch: long enough for batches to form
FRONT_ENDS = 2


def _jpeg(seed: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (64, 48), (seed % 256, 80, 160)).save(out, "JPEG")
    return out.getvalue()


def stop_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to a `clipserve --workers N` and a minute to drain; past it, the tree killed."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        proc.wait()


class Server:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.proc = proc
        self.port = port
        self.log = log
        self.opened: list[http.client.HTTPConnection] = []

    def close_all(self) -> None:
        for conn in self.opened:
            conn.close()
        self.opened.clear()

    def children(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children()

    def stop(self) -> None:
        """SIGTERM and a minute to drain; past it, the whole tree killed."""
        stop_tree(self.proc)

    def front_ends(self) -> list[psutil.Process]:
        """Children listening on the port."""
        found = []
        for child in self.children():
            try:
                conns = child.net_connections(kind="tcp")
            except psutil.NoSuchProcess:
                continue
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == self.port for c in conns):
                found.append(child)
        return found

    def engine(self) -> psutil.Process:
        fronts = {p.pid for p in self.front_ends()}
        (engine,) = [
            p
            for p in self.children()
            if p.pid not in fronts
            and "spawn_main" in " ".join(p.cmdline())
            and p.status() != psutil.STATUS_ZOMBIE
        ]
        return engine

    def connect(self) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=20)
        self.opened.append(conn)
        conn.connect()
        return conn

    def owner(self, conn: http.client.HTTPConnection) -> int:
        """The pid of the front end that accepted this connection."""
        assert conn.sock is not None
        local = conn.sock.getsockname()[1]

        def holder() -> int | None:  # None: accepted, but not yet by a process
            for front in self.front_ends():
                try:
                    conns = front.net_connections(kind="tcp")
                except psutil.NoSuchProcess:  # gone since it was listed
                    continue
                for c in conns:
                    if c.raddr and c.raddr.port == local and c.laddr.port == self.port:
                        return front.pid
            return None

        return until(holder, 2, "a front end holding the connection")

    def spread(self, per_front_end: int) -> dict[int, list[http.client.HTTPConnection]]:
        """Exactly `per_front_end` open connections on each front end."""
        held: dict[int, list[http.client.HTTPConnection]] = {}
        for _ in range(400):
            if len(held) == FRONT_ENDS and all(len(c) == per_front_end for c in held.values()):
                return held
            conn = self.connect()
            pid = self.owner(conn)
            if len(held.get(pid, [])) < per_front_end:
                held.setdefault(pid, []).append(conn)
            else:
                conn.close()
        raise AssertionError(f"could not spread connections: {[len(c) for c in held.values()]}")

    def all_accepting(self) -> bool:
        """Whether every front end accepts: each holds the shared socket from its start, but
        accepts only once its app has started."""
        fronts = {p.pid for p in self.front_ends()}
        owners = set()
        for _ in range(20):
            conn = self.connect()
            owners.add(self.owner(conn))
            conn.close()
            if owners >= fronts:
                return True
        return False

    def get(self, path: str) -> tuple[int, dict[str, str], bytes]:
        conn = self.connect()
        try:
            return request(conn, "GET", path)
        finally:
            conn.close()

    def metric(self, name: str, labels: str = "") -> float:
        _, _, body = self.get("/metrics")
        pattern = re.escape(name + (f"{{{labels}}}" if labels else "")) + r" ([0-9.e+-]+)\n"
        match = re.search(pattern, body.decode())
        return float(match.group(1)) if match else 0.0

    def wait_ready(self, timeout_s: float = 120) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited: {self.log.read_text()[-3000:]}")
            try:
                listening = len(self.front_ends()) == FRONT_ENDS
                return self.get("/readyz")[0] == 200 and listening and self.all_accepting()
            except OSError:
                return False

        try:
            until(ready, timeout_s, "/readyz 200 and every front end accepting", poll_s=0.2)
        except AssertionError as e:
            raise AssertionError(f"{e}: {self.log.read_text()[-3000:]}") from None


def request(
    conn: http.client.HTTPConnection,
    method: str,
    path: str,
    body: bytes | None = None,
    content_type: str = "image/jpeg",
) -> tuple[int, dict[str, str], bytes]:
    headers = {"Content-Type": content_type} if body is not None else {}
    conn.request(method, path, body=body, headers=headers)
    response = conn.getresponse()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()


@pytest.fixture(scope="module")
def server(tiny_config: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = free_port()
    log = tmp_path_factory.mktemp("workers") / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "clipserve",
        "--workers",
        str(FRONT_ENDS),
        "--backend",
        "fake",
        "--backend-option",
        f"latency_ms={LATENCY_MS}",
        "--model",
        str(tiny_config),
        "--pretrained",
        "none",
        "--gpus",
        "cpu",
        "--max-batch-size",
        "16",
        "--max-queue-size",
        "32",
        "--max-items-per-request",
        "8",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "info",
        "--drain-timeout-s",
        "10",
        "--cache-mb",  # these tests count computations of repeated images
        "0",
    ]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    served = Server(proc, port, log)
    try:
        served.wait_ready()
        yield served
    finally:
        if proc.poll() is None:  # a test failed before the SIGTERM test: still clean up
            served.stop()


@pytest.fixture(autouse=True)
def _close_connections(server: Server) -> Iterator[None]:
    yield
    server.close_all()


def _post_all(conns: list[http.client.HTTPConnection]) -> list[int]:
    """One image request on each connection, all at once."""
    start = threading.Barrier(len(conns))

    def post(i: int) -> int:
        start.wait()
        return request(conns[i], "POST", "/embed", _jpeg(i))[0]

    with ThreadPoolExecutor(len(conns)) as pool:
        return list(pool.map(post, range(len(conns))))


def test_one_batch_holds_requests_from_several_front_ends(server: Server) -> None:
    held = server.spread(per_front_end=6)
    count0 = server.metric("clipserve_batch_size_count")
    small0 = server.metric("clipserve_batch_size_bucket", 'le="8.0"')
    with ThreadPoolExecutor(1) as blocker:  # occupies the device while the twelve queue up
        first = blocker.submit(request, server.connect(), "POST", "/embed", _jpeg(99))
        # A sleep: the engine is another process and shows no "computing" state to wait on;
        # a third of a batch's device time gives the first request the device.
        time.sleep(LATENCY_MS / 3000)
        statuses = _post_all([c for conns in held.values() for c in conns])
        assert first.result()[0] == 200
    assert statuses == [200] * 12
    batches = server.metric("clipserve_batch_size_count") - count0
    small = server.metric("clipserve_batch_size_bucket", 'le="8.0"') - small0
    # Each front end sent 6: a batch of more than 8 holds requests from both.
    assert batches - small >= 1, f"{batches} batches, {small} of at most 8 images"


def test_metrics_are_summed_across_front_ends(server: Server) -> None:
    held = server.spread(per_front_end=3)
    ok0 = server.metric("clipserve_requests_total", 'route="/embed",status="200"')
    items0 = server.metric("clipserve_items_total")
    assert _post_all([c for conns in held.values() for c in conns]) == [200] * 6
    # Both front ends answered some: their counters and the engine's are one view. A request
    # is counted once its answer is sent (the observer's `finally`): the client may read its
    # answer a moment before, so the sum is awaited, and must then be exact.
    ok = 'route="/embed",status="200"'
    until(lambda: server.metric("clipserve_requests_total", ok) >= ok0 + 6, 5, "the counts")
    assert server.metric("clipserve_requests_total", ok) == ok0 + 6
    assert server.metric("clipserve_items_total") == items0 + 6


def test_admission_is_global(server: Server) -> None:
    """32 places in the queue, 8 images per request: 2 x 6 requests of 8 images cannot all
    fit, whichever front end they reach."""
    held = server.spread(per_front_end=6)
    conns = [c for cs in held.values() for c in cs]
    start = threading.Barrier(len(conns))

    def post(i: int) -> tuple[int, dict[str, str]]:
        body = msgpack.packb({"images": [_jpeg(i)] * 8})
        start.wait()
        status, headers, _ = request(conns[i], "POST", "/embed", body, "application/msgpack")
        return status, headers

    with ThreadPoolExecutor(len(conns)) as pool:
        results = list(pool.map(post, range(len(conns))))
    statuses = sorted(status for status, _ in results)
    assert set(statuses) == {200, 503}, statuses
    assert all("retry-after" in h for s, h in results if s == 503)
    assert statuses.count(200) <= 32 // 8 + 2  # what fits, plus batches started meanwhile
    # Every admission was given back.
    until(lambda: server.metric("clipserve_queue_depth") == 0, 5, poll_s=0.05)
    assert server.get("/readyz")[0] == 200


def test_tensors_over_the_global_queue_are_refused_and_leave_nothing_held(server: Server) -> None:
    """Raw tensors (parsed on the loop, admitted in the engine) over the 32 places: the
    refused ones answer 503 `overloaded` with Retry-After, the others their 8 rows, and no
    place is left behind in the engine."""
    held = server.spread(per_front_end=6)
    conns = [c for cs in held.values() for c in cs]
    start = threading.Barrier(len(conns))
    body = bytes(8 * 224 * 224 * 3)
    headers = {
        "Content-Type": "application/octet-stream",
        "X-Tensor-Dtype": "uint8",
        "X-Tensor-Shape": "8,224,224,3",
    }

    def post(i: int) -> tuple[int, dict[str, str], bytes]:
        start.wait()
        conns[i].request("POST", "/embed", body=body, headers=headers)
        response = conns[i].getresponse()
        answer = {k.lower(): v for k, v in response.getheaders()}
        return response.status, answer, response.read()

    with ThreadPoolExecutor(len(conns)) as pool:
        results = list(pool.map(post, range(len(conns))))
    statuses = sorted(status for status, _, _ in results)
    assert set(statuses) == {200, 503}, statuses
    for status, headers_of, answer in results:
        if status == 503:
            assert "retry-after" in headers_of
            assert json.loads(answer)["error"]["code"] == "overloaded", answer
        else:
            assert len(json.loads(answer)["embeddings"]) == 8
    until(lambda: server.metric("clipserve_queue_depth") == 0, 5, poll_s=0.05)
    # Nothing left queued, and each front end still admits and answers.
    again = [c for cs in server.spread(per_front_end=2).values() for c in cs]
    for conn in again:
        conn.request("POST", "/embed", body=body, headers=headers)
        response = conn.getresponse()
        assert response.status == 200, response.read()
        response.read()


@pytest.mark.slow  # a multi-process or long variant: CI runs it (make test-slow)
def test_a_killed_front_end_fails_only_its_requests_and_comes_back(server: Server) -> None:
    held = server.spread(per_front_end=3)
    victim, survivor = list(held)
    results: dict[int, list[Any]] = {victim: [], survivor: []}
    stop = threading.Event()

    def load(pid: int, conn: http.client.HTTPConnection) -> None:
        while not stop.is_set():
            try:
                results[pid].append(request(conn, "POST", "/embed", _jpeg(pid))[0])
            except (OSError, http.client.HTTPException) as e:
                results[pid].append(type(e).__name__)
                return  # this connection is gone with its front end

    threads = [threading.Thread(target=load, args=(pid, c)) for pid, cs in held.items() for c in cs]
    for t in threads:
        t.start()
    until(lambda: all(len(results[pid]) >= 3 for pid in held), 30, "both front ends serving")
    engine = server.engine().pid
    os.kill(victim, signal.SIGKILL)
    served_before = len(results[survivor])

    def killed_and_served_on() -> bool:  # every victim connection dropped; the survivor goes on
        dropped = sum(not isinstance(r, int) for r in results[victim])
        return dropped == len(held[victim]) and len(results[survivor]) >= served_before + 6

    until(killed_and_served_on, 30, "the victim's connections dropped, the survivor serving")
    stop.set()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a request hung"
    assert all(r == 200 for r in results[survivor]) and len(results[survivor]) >= 6
    assert any(not isinstance(r, int) for r in results[victim])  # its connections dropped
    assert not list(shm_dir().glob(f"clipserve-{server.proc.pid}-{victim}.*"))  # slots removed
    server.wait_ready(60)  # restarted: two front ends again, and ready
    assert victim not in {p.pid for p in server.front_ends()}
    assert server.engine().pid == engine  # the engine outlived the front end it served
    again = server.spread(per_front_end=2)
    assert _post_all([c for cs in again.values() for c in cs]) == [200] * 4


def test_a_killed_engine_makes_front_ends_answer_503_fast_and_recovers(server: Server) -> None:
    engine = server.engine()
    engine.kill()
    engine.wait(10)
    until(lambda: server.get("/readyz")[0] == 503, 5, "/readyz 503", poll_s=0.05)
    # Live: the supervisor is replacing the engine (a liveness probe failing now would only
    # have the pod load the same model again).
    assert server.get("/healthz")[0] == 200
    conn = server.connect()
    t0 = time.monotonic()
    status, headers, body = request(conn, "POST", "/embed", _jpeg(1))
    assert time.monotonic() - t0 < 2.0  # at once, not at a timeout (generous: shared machine)
    assert status == 503 and "retry-after" in headers
    assert json.loads(body)["error"]["code"] == "not_ready"
    server.wait_ready(120)  # the supervisor restarted it; the front ends reconnected
    assert request(server.connect(), "POST", "/embed", _jpeg(2))[0] == 200


def test_sigterm_drains_every_front_end_and_leaves_nothing_behind(server: Server) -> None:
    held = server.spread(per_front_end=3)
    conns = [c for cs in held.values() for c in cs]
    with ThreadPoolExecutor(len(conns)) as pool:
        futures = [pool.submit(request, c, "POST", "/embed", _jpeg(i)) for i, c in enumerate(conns)]
        # A sleep: the server is other processes and shows no count of requests in flight to
        # wait on; 50 ms puts them in flight (the fake device takes 150 ms a batch).
        time.sleep(0.05)
        server.proc.send_signal(signal.SIGTERM)
        statuses = [f.result()[0] for f in futures]
    assert statuses == [200] * len(conns)
    assert server.proc.wait(60) == 0
    assert not list(shm_dir().glob(f"clipserve-{server.proc.pid}-*"))
    log = server.log.read_text()
    assert "Traceback" not in log, log[-3000:]
