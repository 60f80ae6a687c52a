"""--engine-start-timeout-s: validated, and the supervisor's limit on an engine loading its
model, at the first start and at a restart. A supervisor in this process with a stand-in
engine that never reports ready (no model, no process spawned): the limit is a fraction of a
second here, so nothing waits the default 10 minutes."""

from __future__ import annotations

import multiprocessing
import shutil
import threading
import time
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from typing import cast

import pytest

from clipserve.config import load_config
from clipserve.engine.heartbeat import replace_deadline_s
from clipserve.engine.slots import release_lock
from clipserve.engine.supervisor import Child, Supervisor
from clipserve.errors import ConfigError, StartupError

LIMIT_S = 0.3


class Loading:
    """An engine process that is alive and never ready, until killed."""

    pid = None

    def __init__(self) -> None:
        self.killed = False

    def is_alive(self) -> bool:
        return not self.killed

    def kill(self) -> None:
        self.killed = True


@pytest.fixture
def supervisor() -> Iterator[Supervisor]:
    config = load_config({"engine_start_timeout_s": str(LIMIT_S), "workers": "2"}, {})
    sup = Supervisor(config)
    try:
        yield sup
    finally:
        shutil.rmtree(sup.tmp, ignore_errors=True)
        release_lock(sup.pid, sup._lock)


def _loading(sup: Supervisor) -> tuple[Loading, object]:
    """A stand-in engine, and its end of the ready pipe (nothing is ever sent)."""
    process = Loading()
    receive, send = multiprocessing.Pipe(duplex=False)
    sup.engine = Child("engine", cast(BaseProcess, process))
    sup.engine_ready = receive
    return process, send


@pytest.mark.parametrize("value", ["0", "-5", "nan"])
def test_a_start_timeout_not_positive_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="--engine-start-timeout-s"):
        load_config({"engine_start_timeout_s": value}, {})


def test_the_default_is_ten_minutes_and_the_variable_sets_it() -> None:
    assert load_config({}, {}).http.engine_start_timeout_s == 600.0
    config = load_config({}, {"CLIPSERVE_ENGINE_START_TIMEOUT_S": "3600"})
    assert config.http.engine_start_timeout_s == 3600.0
    assert replace_deadline_s(10.0, 3600.0) - replace_deadline_s(10.0, 600.0) == 3000.0


def test_the_first_start_waits_the_configured_time(supervisor: Supervisor) -> None:
    process, _sender = _loading(supervisor)
    failed: list[BaseException] = []

    def wait() -> None:
        try:
            supervisor._wait_engine_ready()
        except StartupError as e:
            failed.append(e)

    t0 = time.monotonic()
    waiting = threading.Thread(target=wait)
    waiting.start()
    waiting.join(10)
    elapsed = time.monotonic() - t0
    if waiting.is_alive():  # still waiting on another limit: release it, then fail
        supervisor.stopping = True
        waiting.join(5)
        pytest.fail("the supervisor did not use --engine-start-timeout-s")
    assert [str(e) for e in failed] == ["the engine process did not become ready"]
    assert process.killed
    assert LIMIT_S <= elapsed < 5


def test_a_restart_is_given_the_configured_time(supervisor: Supervisor) -> None:
    started: list[object] = []

    def start() -> None:  # what _start_engine does, less the process
        started.append(_loading(supervisor))

    supervisor._start_engine = start  # type: ignore[method-assign]
    t0 = time.monotonic()
    supervisor._restart_engine()
    engine = supervisor.engine
    assert engine is not None and engine.ready_by is not None
    assert LIMIT_S <= engine.ready_by - t0 < LIMIT_S + 1  # the configured time, not 600 s
    process = cast(Loading, engine.process)
    supervisor._engine_starting(engine.ready_by - 0.01)
    assert not process.killed and engine.cause == "exited"
    supervisor._engine_starting(engine.ready_by + 0.01)
    assert process.killed and engine.cause == "hung"
