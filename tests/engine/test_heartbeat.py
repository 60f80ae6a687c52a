"""Liveness by heartbeat: the file a child stamps and the supervisor reads, the verdict, the
device workers' due times, the supervisor's metrics files; then the real thing, end to end."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import io
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from PIL import Image
from prometheus_client import CollectorRegistry, generate_latest, multiprocess

from clipserve.backends.fake import FakeExecutor
from clipserve.batching import Batcher
from clipserve.config import BatchingConfig, load_config
from clipserve.engine.heartbeat import (
    FIRST_BEAT_S,
    Beat,
    Busy,
    HeartbeatReader,
    HeartbeatWriter,
    LivenessMetrics,
    busiest,
    heartbeat_path,
    hung,
    keep_beating,
)
from clipserve.engine.supervisor import prune_metrics
from clipserve.errors import ConfigError
from clipserve.loadgen.procs import free_port
from clipserve.metrics import Metrics
from tests.engine.test_workers_served import FRONT_ENDS, Server, request
from tests.helpers import SPEC_32, marked_array, marked_png, until, until_async


def test_a_stamp_crosses_from_writer_to_reader(tmp_path: Path) -> None:
    path = heartbeat_path(tmp_path, 1234)
    reader = HeartbeatReader(path)
    assert reader.read() is None  # not made yet: no verdict from the file, only from the start
    writer = HeartbeatWriter(path)
    first = reader.read()
    assert first is not None and first.busy is None
    assert abs(first.at - time.monotonic()) < 1.0  # one clock for both processes
    busy = Busy("image:cuda:0", first.at - 3.0, first.at + 7.0)
    writer.stamp(busy)
    second = reader.read()
    assert second is not None and second.busy == busy and second.at >= first.at
    writer.close()
    assert not path.exists()
    assert reader.read() == second  # the mapping outlives the name: the last stamp stays
    reader.close()


def test_a_file_made_but_not_yet_stamped_is_no_beat(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat-1"
    path.write_bytes(b"")
    assert HeartbeatReader(path).read() is None
    path.write_bytes(bytes(72))
    assert HeartbeatReader(path).read() is None  # all zeros: sized, not stamped


def test_the_verdict() -> None:
    now = 1000.0
    assert hung(None, now, 2.0, started=now - 5) is None  # starting: FIRST_BEAT_S to stamp
    assert "no heartbeat" in str(hung(None, now, 2.0, started=now - FIRST_BEAT_S - 1))
    assert hung(Beat(now - 1.9, None), now, 2.0, started=0) is None
    assert hung(Beat(now - 2.5, None), now, 2.0, started=0) == "event loop silent for 2.5 s"
    computing = Busy("text:cpu", now - 30.0, now + 0.5)
    assert hung(Beat(now, computing), now, 2.0, started=0) is None  # long, not yet due
    late = Busy("text:cpu", now - 30.0, now - 0.1)
    assert hung(Beat(now, late), now, 2.0, started=0) == "text:cpu worker mid-batch for 30.0 s"


def test_a_blocked_loop_stops_the_stamps(tmp_path: Path) -> None:
    async def main() -> tuple[float, float]:
        writer = HeartbeatWriter(tmp_path / "heartbeat-2")
        reader = HeartbeatReader(writer.path)
        task = asyncio.create_task(keep_beating(writer, interval_s=0.05))
        try:
            await asyncio.sleep(0.3)
            running = reader.age(time.monotonic(), 0.0)
            # The loop blocked, as by a stopped process or CPU work on it.
            time.sleep(1.0)  # noqa: ASYNC251
            return running, reader.age(time.monotonic(), 0.0)
        finally:
            task.cancel()
            writer.close()

    running, blocked = asyncio.run(main())
    assert running < 0.9  # stamped every 50 ms (generous: a loaded machine)
    assert blocked >= 1.0


def test_a_worker_is_due_by_its_expected_batch_time_plus_the_margin() -> None:
    """Unmeasured, a batch is given `unmeasured_s`; once measured, its cost model's time.
    An idle worker is never due."""

    async def main() -> None:
        fake = FakeExecutor(SPEC_32, 16, "sim:0", latency_ms=400)
        batcher = Batcher([fake], BatchingConfig(8, 64, 0.0), Metrics())
        worker = batcher.workers[0]
        batcher.start()
        try:
            assert busiest(batcher.workers, 2.0, 30.0) is None  # idle, queue empty: fine
            for expected_s in (30.0, None):
                run = asyncio.create_task(_embed_one(batcher))
                await until_async(lambda: worker.running is not None, 5)
                busy = busiest(batcher.workers, 2.0, 30.0)
                assert busy is not None and busy.what == "image:sim:0"
                assert abs(busy.since - time.monotonic()) < 1.0
                if expected_s is None:  # measured: about the fake's 400 ms
                    expected_s = worker.cost.seconds(1)
                    assert 0.3 < expected_s < 3.0
                assert busy.due - busy.since == pytest.approx(expected_s + 2.0)
                await run
                assert busiest(batcher.workers, 2.0, 30.0) is None
        finally:
            await batcher.stop()

    asyncio.run(main())


async def _embed_one(batcher: Batcher) -> None:
    ticket = batcher.admit(1, time.perf_counter() + 10)
    await batcher.run(ticket, [marked_array(1)], normalize=False, request_id="r")


def test_the_supervisors_metrics_read_as_any_process_s(tmp_path: Path) -> None:
    metrics = LivenessMetrics(tmp_path, ["engine", "frontend-0", "frontend-1"])
    metrics.ages({"engine": 0.25, "frontend-0": 1.5})
    metrics.restarted("engine", "hung")
    metrics.restarted("engine", "hung")
    metrics.restarted("frontend-1", "exited")
    prune_metrics(tmp_path, 4321)  # a dead child's pruning leaves them
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, str(tmp_path))  # type: ignore[no-untyped-call]
    text = generate_latest(registry).decode()
    metrics.close()
    assert 'clipserve_heartbeat_age_seconds{process="engine"} 0.25' in text
    assert 'clipserve_heartbeat_age_seconds{process="frontend-0"} 1.5' in text
    assert 'clipserve_restarts_total{cause="hung",process="engine"} 2.0' in text
    assert 'clipserve_restarts_total{cause="exited",process="frontend-1"} 1.0' in text
    # Series never restarted read 0 (increase() counts a first restart from there).
    assert 'clipserve_restarts_total{cause="exited",process="frontend-0"} 0.0' in text
    assert 'clipserve_restarts_total{cause="hung",process="frontend-1"} 0.0' in text
    assert "pid=" not in text


def test_the_timeout_is_checked() -> None:
    assert load_config({}, {}).http.heartbeat_timeout_s == 10.0
    assert load_config({"heartbeat_timeout_s": "2"}, {}).http.heartbeat_timeout_s == 2.0
    with pytest.raises(ConfigError, match="--heartbeat-timeout-s"):
        load_config({"heartbeat_timeout_s": "0.5"}, {})


# ---- end to end: `clipserve --workers 2 --backend fake`, real signals -------------------------

TIMEOUT_S = 3.0  # --heartbeat-timeout-s: short, so that the tests take seconds
HANG = 9  # a batch holding an image marked so never returns from the (fake) device


@pytest.fixture(scope="module")
def server(tiny_config: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = free_port()
    log = tmp_path_factory.mktemp("heartbeat") / "server.log"
    cmd = [sys.executable, "-m", "clipserve", "--workers", str(FRONT_ENDS), "--backend", "fake"]
    cmd += ["--backend-option", "latency_ms=20", "--backend-option", f"hang_pixel={HANG}"]
    cmd += ["--model", str(tiny_config)]
    cmd += ["--pretrained", "none", "--gpus", "cpu", "--port", str(port)]
    cmd += ["--heartbeat-timeout-s", str(TIMEOUT_S), "--drain-timeout-s", "5"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    served = Server(proc, port, log)
    try:
        served.wait_ready()
        yield served
    finally:
        for process in [psutil.Process(proc.pid), *served.children()]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.resume()  # a test that failed midway may have left one stopped
        served.stop()


@pytest.fixture(autouse=True)
def _close_connections(server: Server) -> Iterator[None]:
    yield
    server.close_all()


def _jpeg(seed: int = 0) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (64, 48), (100, seed % 256, 160)).save(out, "JPEG")  # red: never HANG
    return out.getvalue()


def _gauges(server: Server, name: str) -> dict[str, float]:
    """Every sample of `name` by its labels, from one scrape."""
    _, _, body = server.get("/metrics")
    pattern = re.escape(name) + r"\{([^}]*)\} ([0-9.e+-]+)\n"
    return {labels: float(value) for labels, value in re.findall(pattern, body.decode())}


def _logged(server: Server, text: str) -> bool:
    return text in server.log.read_text()


def _replaced(server: Server, engine: psutil.Process) -> None:
    """The stopped engine killed, a new one up, requests served again."""
    engine.wait(TIMEOUT_S + 30)  # gone: killed by the supervisor (SIGCONT is never sent)
    server.wait_ready(120)
    assert server.engine().pid != engine.pid
    assert request(server.connect(), "POST", "/embed", _jpeg())[0] == 200


def test_a_stopped_engine_fails_readiness_is_killed_and_replaced(server: Server) -> None:
    engine = server.engine()
    before = _gauges(server, "clipserve_restarts_total")
    assert _gauges(server, "clipserve_heartbeat_age_seconds").keys() == {
        'process="engine"',
        'process="frontend-0"',
        'process="frontend-1"',
    }
    stopped = time.monotonic()
    engine.suspend()  # SIGSTOP: alive, its sockets open, silent
    until(lambda: server.get("/readyz")[0] == 503, TIMEOUT_S + 10, poll_s=0.1)
    assert time.monotonic() - stopped < TIMEOUT_S + 5  # within the deadline (+ a loaded machine)
    until(lambda: _logged(server, f"engine (pid {engine.pid}) is hung: event loop silent"), 10)
    _replaced(server, engine)
    restarts = _gauges(server, "clipserve_restarts_total")
    hung_engine = 'cause="hung",process="engine"'
    assert restarts[hung_engine] == before.get(hung_engine, 0.0) + 1
    assert _gauges(server, "clipserve_heartbeat_age_seconds")['process="engine"'] < TIMEOUT_S


@pytest.mark.slow  # a multi-process or long variant: CI runs it (make test-slow)
def test_a_device_call_that_never_returns_gets_the_engine_replaced(server: Server) -> None:
    """The engine's loop beats on; its worker's batch is past due (its measured time, about
    20 ms, plus the timeout): the request fails 503 when the engine is killed, not at its
    deadline (30 s), and the new engine serves."""
    engine = server.engine()
    before = _gauges(server, "clipserve_restarts_total").get('cause="hung",process="engine"', 0)
    started = time.monotonic()
    status, _, body = request(server.connect(), "POST", "/embed", marked_png(HANG), "image/png")
    assert status == 503, body
    assert time.monotonic() - started < TIMEOUT_S + 5
    assert _logged(server, f"engine (pid {engine.pid}) is hung: image:cpu worker mid-batch")
    _replaced(server, engine)
    after = _gauges(server, "clipserve_restarts_total")['cause="hung",process="engine"']
    assert after == before + 1


@pytest.mark.slow  # a multi-process or long variant: CI runs it (make test-slow)
def test_front_ends_report_a_silent_engine_while_nobody_replaces_it(server: Server) -> None:
    """With the supervisor stopped too, every front end's own view: not ready, workers dead,
    new requests 503 at once; past the restart deadline (2 x the timeout), not live either."""
    supervisor, engine = psutil.Process(server.proc.pid), server.engine()
    held = [conns[0] for conns in server.spread(per_front_end=1).values()]

    def on_each(path: str) -> list[int]:
        return [request(conn, "GET", path)[0] for conn in held]

    supervisor.suspend()
    engine.suspend()
    try:
        until(lambda: on_each("/readyz") == [503, 503], TIMEOUT_S + 10, poll_s=0.1)
        assert on_each("/healthz") == [200, 200]  # silent, not yet for 2 x the timeout
        for conn in held:
            _, _, body = request(conn, "GET", "/metrics")
            alive = re.findall(r"clipserve_worker_alive\{[^}]*\} ([0-9.]+)", body.decode())
            assert alive and set(alive) == {"0.0"}, alive
            started = time.monotonic()
            status, headers, body = request(conn, "POST", "/embed", _jpeg())
            assert time.monotonic() - started < 5  # at once, not at the request's deadline
            assert status == 503 and "retry-after" in headers, body
            assert b"has not reported" in body
        until(lambda: on_each("/healthz") == [503, 503], 2 * TIMEOUT_S + 10, poll_s=0.1)
    finally:
        supervisor.resume()
    until(lambda: _logged(server, f"engine (pid {engine.pid}) is hung"), 10)
    _replaced(server, engine)


@pytest.mark.slow  # a multi-process or long variant: CI runs it (make test-slow)
def test_a_stopped_front_end_is_replaced_while_the_other_serves(server: Server) -> None:
    held = server.spread(per_front_end=2)
    victim, survivor = list(held)
    with ThreadPoolExecutor(1) as pool:
        victim_process = psutil.Process(victim)
        victim_process.suspend()
        stranded = pool.submit(request, held[victim][0], "POST", "/embed", _jpeg(1))
        statuses: list[int] = []
        give_up = time.monotonic() + TIMEOUT_S + 30
        while victim_process.is_running() and victim_process.status() != psutil.STATUS_ZOMBIE:
            for conn in held[survivor]:  # the other front end's connections: served on
                seed = len(statuses)  # a new image each time: none answered from the cache
                status, _, body = request(conn, "POST", "/embed", _jpeg(seed))
                statuses.append(status)
                assert status == 200, body
            if time.monotonic() > give_up:
                raise AssertionError("the stopped front end was never killed")
        with pytest.raises((OSError, http.client.HTTPException)):
            stranded.result(30)  # its connection closed with it: failed, not left hanging
    assert statuses and set(statuses) == {200}
    assert _logged(server, f"(pid {victim}) is hung: event loop silent")
    server.wait_ready(120)
    assert victim not in {p.pid for p in server.front_ends()}
    restarts = _gauges(server, "clipserve_restarts_total")
    assert sum(v for k, v in restarts.items() if 'cause="hung",process="frontend-' in k) == 1
