"""`--workers N` startup failures: one line, exit 2, nothing left behind."""

from __future__ import annotations

import socket
import subprocess
import tempfile
from pathlib import Path

from clipserve.loadgen.procs import free_port
from tests.helpers import run_clipserve


def _run(*flags: str) -> subprocess.CompletedProcess[str]:
    return run_clipserve("--workers", "2", "--backend", "fake", "--host", "127.0.0.1", *flags)


def test_an_engine_that_cannot_start_is_one_line_and_exit_2(tiny_config: Path) -> None:
    result = _run("--model", "no-such-model", "--port", str(free_port()))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "clipserve: error: --model: unknown open_clip model 'no-such-model'" in result.stderr
    assert "Traceback" not in result.stderr


def _own_dirs() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("clipserve-*"))


def test_a_taken_port_is_refused_before_anything_starts(tiny_config: Path) -> None:
    before = _own_dirs()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _run("--model", str(tiny_config), "--pretrained", "none", "--port", str(port))
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert _own_dirs() <= before  # its socket and metrics directory went with it
