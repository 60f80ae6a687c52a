"""The `--workers 2` supervisor around its children's lives, with real processes and signals:
a SIGTERM while the model loads, a front end that dies during the first start, a front end
that dies with the engine, and a metrics directory of the user's own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from clipserve.loadgen.procs import free_port
from tests.engine.test_workers_served import Server, stop_tree
from tests.helpers import until


def _spawned(proc: subprocess.Popen[bytes]) -> list[psutil.Process]:
    """The supervisor's children that run our code (multiprocessing's spawn), oldest first."""
    found = []
    for child in psutil.Process(proc.pid).children():
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return sorted(found, key=lambda p: p.create_time())


def _gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _start(tiny_config: Path, log: Path, **env: str) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    cmd = [sys.executable, "-m", "clipserve", "--workers", "2", "--backend", "fake"]
    cmd += ["--model", str(tiny_config), "--pretrained", "none", "--gpus", "cpu"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--drain-timeout-s", "5"]
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
        )
    return proc, port


def test_sigterm_while_the_engine_loads_is_a_clean_stop(tiny_config: Path, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    proc, _ = _start(tiny_config, log)
    try:
        until(lambda: _spawned(proc), 60, "the engine process")  # loading its model now
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
    finally:
        stop_tree(proc)
    assert "error" not in log.read_text().lower(), log.read_text()[-3000:]


@pytest.mark.slow  # a multi-process or long variant: CI runs it (make test-slow)
def test_a_front_end_lost_during_the_first_start_does_not_hold_the_other(
    tiny_config: Path, tmp_path: Path
) -> None:
    """The first start holds each front end at a barrier until all have imported; one killed
    before it gets there, and restarted without it, must not keep the other waiting for the
    barrier's 60 s."""
    log = tmp_path / "server.log"
    proc, port = _start(tiny_config, log)
    server = Server(proc, port, log)
    try:
        first = until(lambda: len(_spawned(proc)) >= 3 and _spawned(proc), 120, "front ends")
        first[-1].kill()  # the newest: a front end, importing
        started = time.monotonic()
        server.wait_ready(120)  # both front ends listening: the replacement alone is not it
        assert time.monotonic() - started < 45  # not the barrier's 60 s and more
    finally:
        server.stop()


@pytest.mark.slow  # a multi-process or long variant: CI runs it (make test-slow)
def test_a_front_end_that_dies_with_the_engine_starts_once_the_new_engine_is_ready(
    tiny_config: Path, tmp_path: Path
) -> None:
    """Started against no engine, a front end gives up after 60 s (a slow model load) and is
    restarted as a failure: it waits for the new engine instead."""
    log = tmp_path / "server.log"
    proc, port = _start(tiny_config, log)
    server = Server(proc, port, log)
    try:
        server.wait_ready()
        engine, front = server.engine(), server.front_ends()[0]
        old = {p.pid for p in server.children()}
        engine.kill()
        front.kill()
        until(lambda: _gone(engine) and _gone(front), 30, "the killed processes gone")

        def replaced() -> psutil.Process | None:
            # The surviving front end may answer ready until it sees the engine's channel
            # close: wait for an engine that is not the old one, with both front ends ready.
            server.wait_ready(120)
            try:
                found = server.engine()
            except (ValueError, psutil.NoSuchProcess):  # none yet, or a front end not listening
                return None
            return found if found.pid not in old else None

        new_engine = until(replaced, 150, "a new engine and both front ends ready")
        (new_front,) = [p for p in server.front_ends() if p.pid not in old]
        assert new_engine.pid not in old
        # A new engine takes seconds to load and warm; the front end came after it was ready.
        assert new_front.create_time() > new_engine.create_time() + 0.5
        assert f"engine restarted (pid {new_engine.pid})" in log.read_text()
    finally:
        server.stop()


@pytest.mark.slow  # a multi-process or long variant: CI runs it (make test-slow)
def test_a_metrics_directory_of_the_users_own_is_emptied_at_the_stop(
    tiny_config: Path, tmp_path: Path
) -> None:
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    log = tmp_path / "server.log"
    proc, port = _start(tiny_config, log, PROMETHEUS_MULTIPROC_DIR=str(metrics))
    server = Server(proc, port, log)
    try:
        server.wait_ready()
        assert httpx.get(f"http://127.0.0.1:{port}/metrics").status_code == 200
        assert list(metrics.glob("*.db"))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        server.stop()
    assert not list(metrics.glob("*.db"))


@pytest.mark.slow  # a multi-process or long variant: CI runs it (make test-slow)
def test_an_engine_that_dies_soon_after_its_load_is_restarted_with_backoff(
    tiny_config: Path, tmp_path: Path
) -> None:
    """Young is counted from readiness, not from the spawn: an engine whose model took longer
    to load than the 10 s of youth, dying soon after, was restarted at once, for ever."""
    log = tmp_path / "server.log"
    proc, port = _start(tiny_config, log)
    server = Server(proc, port, log)
    try:
        (engine,) = until(lambda: _spawned(proc), 60, "the engine process", poll_s=0.005)
        spawned = time.monotonic()  # (psutil's create_time is off by up to a second)
        server.wait_ready()
        # 10.3 s after its spawn, and so (its load took seconds) under 10 s after its ready.
        wait_s = spawned + 10.3 - time.monotonic()
        if wait_s <= 0:  # a machine this loaded cannot tell the two clocks apart
            pytest.skip("the engine took over 10 s to be ready: this test needs it faster")
        time.sleep(wait_s)
        engine.kill()
        until(lambda: "restarting it in" in log.read_text(), 30, "the restart logged")
        assert "exited with -9; restarting it in 0.5 s" in log.read_text(), log.read_text()
    finally:
        server.stop()
