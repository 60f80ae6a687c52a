"""--shutdown-delay-s: on SIGTERM a real `clipserve` process answers readiness 503 on every
door (HTTP, KServe, gRPC) while it goes on serving, then drains and exits 0; a second SIGTERM
skips the rest of the delay. One process and, in the slow run, `--workers 2`."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import tritonclient.grpc as tg

from clipserve.loadgen.procs import free_port, server_command, stop, wait_ready
from tests.helpers import PNG, cli_server, png_bytes, random_pixels

DELAY_S = 4.0


def _args(tiny_config: Path, tiny_checkpoint: Path, *extra: str) -> list[str]:
    return [
        "--model",
        str(tiny_config),
        "--checkpoint",
        str(tiny_checkpoint),
        "--backend",
        "fake",
        "--log-level",
        "info",
        *extra,
    ]


def _wait_exit(proc: subprocess.Popen[bytes], timeout_s: float) -> tuple[int, float]:
    t0 = time.monotonic()
    code = proc.wait(timeout=timeout_s)
    return code, time.monotonic() - t0


@pytest.mark.parametrize(
    "workers", [pytest.param(1, id="in-process"), pytest.param(2, marks=pytest.mark.slow)]
)
def test_sigterm_turns_readiness_off_and_serves_on_for_the_delay(
    tiny_config: Path, tiny_checkpoint: Path, tmp_path: Path, workers: int
) -> None:
    grpc_port = free_port()
    flags = ["--shutdown-delay-s", str(DELAY_S), "--grpc-port", str(grpc_port)]
    flags += ["--workers", str(workers)]
    args = _args(tiny_config, tiny_checkpoint, *flags)
    image = png_bytes(random_pixels(1))
    log = tmp_path / "server.log"
    with cli_server(args, log) as (proc, url), httpx.Client(base_url=url, timeout=10) as client:
        grpc = tg.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        assert client.get("/readyz").status_code == 200
        assert grpc.is_server_ready()

        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        ready = client.get("/readyz")
        deadline = t0 + 2.0
        while ready.status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
            ready = client.get("/readyz")
        assert ready.status_code == 503, ready.text
        assert ready.json()["stopping"] is True
        assert ready.json()["ready"] is False
        # Every door's readiness says the same; liveness does not change.
        assert client.get("/v2/health/ready").status_code == 503
        assert not grpc.is_server_ready()
        assert client.get("/healthz").status_code == 200
        # Still serving: requests on this connection and on new ones are answered, and each
        # answer closes its connection so the client moves on before the drain.
        kept = client.post("/embed", content=image, headers=PNG)
        assert kept.status_code == 200 and kept.headers["connection"] == "close"
        assert httpx.post(url + "/embed", content=image, headers=PNG).status_code == 200
        assert proc.poll() is None
        grpc.close()

        code, _ = _wait_exit(proc, DELAY_S + 30)
        elapsed = time.monotonic() - t0
    assert code == 0
    assert DELAY_S - 0.5 <= elapsed < DELAY_S + 15, elapsed
    text = log.read_text()
    assert "readiness 503, serving 4.0 s more, then draining" in text
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/healthz")  # the listener is closed


@pytest.mark.slow  # ~8 s: a second server process
def test_a_second_sigterm_drains_at_once(
    tiny_config: Path, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    args = _args(tiny_config, tiny_checkpoint, "--shutdown-delay-s", "60")
    with cli_server(args, tmp_path / "server.log") as (proc, url):
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 2.0
        while httpx.get(url + "/readyz").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(url + "/readyz").status_code == 503
        proc.send_signal(signal.SIGTERM)  # as a process group's SIGTERM arrives twice: one stop
        time.sleep(1.5)
        assert proc.poll() is None and httpx.get(url + "/readyz").status_code == 503
        proc.send_signal(signal.SIGTERM)  # a second or more later: drain now
        code, elapsed = _wait_exit(proc, 30)
    assert code == 0
    assert elapsed < 10, elapsed


@pytest.mark.slow  # ~10 s: two front ends and an engine
def test_a_sigterm_to_the_process_group_keeps_the_delay(
    tiny_config: Path, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """systemd and `kill -- -PGID` signal every process: each front end gets SIGTERM from the
    group and again from the supervisor, and still serves the delay out."""
    args = _args(tiny_config, tiny_checkpoint, "--shutdown-delay-s", str(DELAY_S))
    port = free_port()
    cmd = server_command([*args, "--workers", "2", "--grpc-port", "0"], port)
    url = f"http://127.0.0.1:{port}"
    with (tmp_path / "server.log").open("w") as log:
        # A session of its own: the group signalled is the server's, not the test runner's.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(proc, url, 90, "server")
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        time.sleep(1.5)
        assert httpx.get(url + "/healthz").status_code == 200  # still serving
        assert httpx.get(url + "/readyz").status_code == 503
        code, _ = _wait_exit(proc, DELAY_S + 30)
        assert code == 0
        assert time.monotonic() - t0 >= DELAY_S - 0.5
    finally:
        stop(proc)
